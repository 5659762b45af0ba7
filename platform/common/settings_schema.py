"""How a setting is declared: `setting(default, help, group)` holds a field's default, help text, flag group and
parser once, in its metadata, for the fields of every process kind (settings_common.py, settings_api.py,
settings_jax_worker.py, settings_up.py). The CLI's flags and their help are generated from it
(`tinkerflow.cli.flags`), and `settings.py` reads each field from its `TINKERFLOW_<FIELD_NAME>` variable."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from pathlib import Path
from typing import Any

from tinkerflow.common.errors import UserError

ENV_PREFIX = "TINKERFLOW_"

# Flag groups: each sub-command of the CLI shows the groups it needs (cli/main.py); titles head its --help sections.
COMMON, MODEL, API, DEV_TEMPORAL, SUPERVISION, JAX_WORKER, MESH, RAY = (
    "common",
    "model",
    "api",
    "dev-temporal",
    "supervision",
    "jax-worker",
    "mesh",
    "ray",
)
ENGINE_ENV, TEST_HOOK = "engine-env", "test-hook"
ENV_ONLY = (ENGINE_ENV, TEST_HOOK)
GROUP_TITLES = {
    COMMON: "common",
    MODEL: "base model and JAX worker",
    API: "HTTP API",
    DEV_TEMPORAL: "Temporal dev server (when no --temporal-address is given)",
    SUPERVISION: "supervision by `up`",
    JAX_WORKER: "JAX worker (multi-host: one process per host)",
    MESH: "device mesh",
    RAY: "Ray placement",
}


class SettingsError(UserError):
    """A TINKERFLOW_* variable (or flag) whose value does not parse as its field's type (a usage error: exit 2)."""


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


def parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def parse_keys(raw: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in raw.split(",") if k.strip())


def parse_sizes(raw: str) -> tuple[int, ...]:
    sizes = tuple(int(k) for k in parse_keys(raw))
    if not sizes or min(sizes) < 1:
        raise ValueError("expected positive whole numbers, comma-separated")
    return sizes


def parse_path(raw: str) -> Path:
    return Path(raw).expanduser().resolve()


def _parser_for(default: Any) -> Callable[[str], Any]:
    if isinstance(default, bool):
        return parse_bool
    if isinstance(default, tuple):
        return parse_keys
    if isinstance(default, (int, float)):
        return type(default)
    return str


def setting(
    default: Any,
    help: str,
    group: str,
    *,
    shown: str | None = None,
    aliases: tuple[str, ...] = (),
    choices: tuple[str, ...] = (),
    metavar: str | None = None,
    env_fallbacks: tuple[str, ...] = (),
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A Settings field: `default` (a callable: computed when the field is read), `help` (one sentence, no
    default in it: the flag's help adds the default and the env var), `group` (which sub-commands get the flag),
    `shown` (the default as a person reads it, where its value says little), `aliases` (older flag names that
    keep working), `env_fallbacks` (variables read after TINKERFLOW_<NAME>, e.g. Ray's own RAY_ADDRESS)."""
    meta = {
        "default": default,
        "help": help,
        "group": group,
        "shown": shown,
        "aliases": aliases,
        "choices": choices,
        "metavar": metavar,
        "env_fallbacks": env_fallbacks,
        "parse": parse or _parser_for(default),
    }
    return field(default=UNSET, metadata=meta)


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()
