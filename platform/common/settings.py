"""Settings shared by every process kind, from flags and `TINKERFLOW_*` environment variables.

One frozen dataclass, `Settings`, so a process's whole configuration is visible in one place and can be logged at
start-up. Its fields are declared by process, each module a table a reader of that process can hold in one view
(settings_common.py: every process; settings_api.py: the HTTP API; settings_jax_worker.py: a JAX worker;
settings_up.py: the launchers `up`, `temporal` and `ray`), and `Settings` inherits them all. Each field states its
default, its help text and its flag group once, in its metadata (`settings_schema.setting`); the CLI's flags and
their help are generated from it (`tinkerflow.cli.flags`), and every field is read from `TINKERFLOW_<FIELD_NAME>`.
Flags win over the environment, the environment wins over the defaults. Fields in `ENV_ONLY` groups have no flag:
tuning knobs read where no Settings object reaches, and test hooks. This module is the one reader of the
environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinkerflow.common.settings_api import ApiSettings
from tinkerflow.common.settings_common import CommonSettings
from tinkerflow.common.settings_jax_worker import JaxWorkerSettings
from tinkerflow.common.settings_schema import (
    API,
    COMMON,
    DEV_TEMPORAL,
    ENGINE_ENV,
    ENV_ONLY,
    ENV_PREFIX,
    GROUP_TITLES,
    JAX_WORKER,
    MESH,
    MODEL,
    RAY,
    SUPERVISION,
    TEST_HOOK,
    UNSET,
    SettingsError,
    env_name,
    setting,
)
from tinkerflow.common.settings_up import LauncherSettings

__all__ = [
    "API",
    "COMMON",
    "DEV_TEMPORAL",
    "ENGINE_ENV",
    "ENV_ONLY",
    "ENV_PREFIX",
    "GROUP_TITLES",
    "JAX_WORKER",
    "MESH",
    "MODEL",
    "RAY",
    "SUPERVISION",
    "TEST_HOOK",
    "Settings",
    "SettingsError",
    "config_fields",
    "env_name",
    "env_names",
    "env_setting",
    "setting",
]


# Bases last-first: a dataclass collects its bases' fields from the end of its MRO, so the common fields come first
# and `--help`, `as_env` and the tests see them in the order a reader expects.
@dataclass(frozen=True)
class Settings(LauncherSettings, ApiSettings, JaxWorkerSettings, CommonSettings):
    # Which fields came from the environment or a flag rather than their default (e.g. `up` starts its own Temporal
    # only when no address was given). Not configuration itself: no flag, no variable.
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        given = set(self.given)
        for f in config_fields():
            if getattr(self, f.name) is not UNSET:
                continue
            raw, source = _from_env(f)
            if source:
                value = _parse(f, raw, source)
                given.add(f.name)
            else:
                default = f.metadata["default"]
                value = default() if callable(default) else default
            object.__setattr__(self, f.name, value)
        object.__setattr__(self, "given", frozenset(given))

    def is_given(self, name: str) -> bool:
        """The field was set by a flag, the environment or the caller, not left at its default."""
        f = next(f for f in config_fields() if f.name == name)
        default = f.metadata["default"]
        return name in self.given or getattr(self, name) != (default() if callable(default) else default)

    def as_env(self) -> dict[str, str]:
        """Every field as the TINKERFLOW_* variable that reads back to the same value (the store and checkpoint
        roots resolved against this state dir): what a child process needs to share this configuration. The
        ENV_ONLY fields are left out: they are read from the environment where they are used, so a child inherits
        the variable itself (a test may set a fault hook after this Settings was made)."""
        values = {f.name: getattr(self, f.name) for f in config_fields() if f.metadata["group"] not in ENV_ONLY}
        values.update(store_url=self.resolved_store_url, checkpoint_root=self.resolved_checkpoint_root)
        return {env_name(name): _to_env(value) for name, value in values.items()}

    @property
    def resolved_store_url(self) -> str:
        return self.store_url or (self.state_dir / "store").as_uri()

    @property
    def resolved_checkpoint_root(self) -> str:
        return self.checkpoint_root or (self.state_dir / "checkpoints").as_uri()

    @property
    def resolved_temporal_ui_url(self) -> str:
        """--temporal-ui-url, else where `tinkerflow up`'s dev server serves its UI (the frontend's host, --ui-port)."""
        if self.temporal_ui_url:
            return self.temporal_ui_url.rstrip("/")
        host = self.temporal_address.rsplit(":", 1)[0] or "127.0.0.1"
        return f"http://{host}:{self.ui_port}"

    @property
    def resolved_compilation_cache_dir(self) -> Path | None:
        if self.compilation_cache_dir == "off":
            return None
        return (
            Path(self.compilation_cache_dir).expanduser()
            if self.compilation_cache_dir
            else self.state_dir / "xla-cache"
        )

    def accepted_api_keys(self) -> tuple[str, ...]:
        keys = list(self.api_keys)
        if self.api_keys_file:
            for line in Path(self.api_keys_file).expanduser().read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    keys.append(line)
        if self.admin_api_key:  # the operator's key is a key too: a tenant of its own that also sees all usage
            keys.append(self.admin_api_key)
        return tuple(dict.fromkeys(keys))

    def check_api(self) -> None:
        """SettingsError for what the API cannot start with, beyond each field's own parse (a flag's number is
        parsed by argparse)."""
        if self.ledger_read_s <= 0:
            raise SettingsError(f"--ledger-read-s must be above 0, got {self.ledger_read_s:g}")

    @property
    def models_dir(self) -> Path:
        return self.state_dir / "models"

    def with_args(self, args: argparse.Namespace) -> Settings:
        """Overlay the flags a user actually gave (the generated flags default to None)."""
        changes: dict[str, Any] = {}
        for f in config_fields():
            value = getattr(args, f.name, None)
            if value is None:
                continue
            if isinstance(value, list):  # a repeatable flag (--api-key): each item may itself be comma-separated
                value = ",".join(value)
            changes[f.name] = _parse(f, value, "--" + f.name.replace("_", "-")) if isinstance(value, str) else value
        return dataclasses.replace(self, given=self.given | set(changes), **changes)


def _to_env(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def config_fields() -> Iterator[dataclasses.Field]:
    """The configuration fields (each with a TINKERFLOW_* variable), in declaration order."""
    return (f for f in dataclasses.fields(Settings) if "group" in f.metadata)


def env_names(f: dataclasses.Field) -> tuple[str, ...]:
    return (env_name(f.name), *f.metadata["env_fallbacks"])


def _from_env(f: dataclasses.Field) -> tuple[str, str]:
    for name in env_names(f):
        if name in os.environ:
            return os.environ[name], name
    return "", ""


def _parse(f: dataclasses.Field, raw: str, source: str) -> Any:
    try:
        value = f.metadata["parse"](raw)
    except ValueError as e:
        raise SettingsError(f"{source}={raw!r}: not a valid {f.name} ({e})") from None
    choices = f.metadata["choices"]
    if choices and value not in choices:
        raise SettingsError(f"{source}={raw!r}: {f.name} must be one of {', '.join(choices)}")
    return value


def env_setting(name: str) -> Any:
    """One field as the environment sets it (or its default): for the ENV_ONLY fields, read where no Settings
    object is passed (the engine's sampler, test hooks in activities)."""
    f = next(f for f in config_fields() if f.name == name)
    raw, source = _from_env(f)
    if source:
        return _parse(f, raw, source)
    default = f.metadata["default"]
    return default() if callable(default) else default
