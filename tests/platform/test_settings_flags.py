"""One source of config: every Settings field is a flag and a TINKERFLOW_* variable, both reach the field (the flag
wins), help names the default and the variable, and no code reads a variable behind Settings' back."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tinkerflow.cli.flags import NOT_SETTINGS, flag_name
from tinkerflow.cli.main import COMMAND_GROUPS, build_parser, main
from tinkerflow.common.settings import ENV_ONLY, Settings, SettingsError, config_fields, env_name, env_setting

FIELDS = list(config_fields())
FLAGGED = [f for f in FIELDS if f.metadata["group"] not in ENV_ONLY]

# Flag names scripts/, docs, infra/ manifests and tests used before the flags were generated: all must keep working.
OLD_FLAGS = {
    "--state-dir",
    "--temporal-address",
    "--temporal-namespace",
    "--temporal-tls-cert",
    "--temporal-tls-key",
    "--temporal-tls-ca",
    "--store-url",
    "--store-retention-s",
    "--checkpoint-root",
    "--log-level",
    "--log-format",
    "--base-model",
    "--served-model-name",
    "--max-lora-adapters",
    "--max-lora-rank",
    "--pool",
    "--snapshot-budget-mb",
    "--metrics-port",
    "--host",
    "--port",
    "--api-key",
    "--api-keys-file",
    "--session-timeout-s",
    "--max-request-bytes",
    "--max-queued-sample-tokens",
    "--max-sample-body-bytes",
    "--max-control-body-bytes",
    "--max-samples-per-request",
    "--max-sample-tokens",
    "--max-datums-per-request",
    "--auto-snapshot-every",
    "--url-signing-key",
    "--metrics-access",
    "--api-docs",
    "--max-queued-samples",
    "--temporal-port",
    "--ui-port",
    "--headless",
    "--restart-backoff-s",
    "--restart-backoff-max-s",
    "--crash-loop-restarts",
    "--crash-loop-window-s",
    "--up-metrics-port",
    "--worker-id",
    "--coordinator-address",
    "--num-processes",
    "--process-id",
    "--mesh-fsdp",
    "--mesh-tp",
    "--mesh-ep",
    "--ray-address",
    "--hosts",
    "--cpus-per-host",
    "--gpus-per-host",
    "--tpus-per-host",
    "--strategy",
    "--max-restarts",
    "--with-stack",
    "--ready-file",
}


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _actions(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if a.option_strings]


def _all_flags() -> dict[str, argparse.Action]:
    return {opt: a for p in _commands().values() for a in _actions(p) for opt in a.option_strings}


def _sample(f) -> tuple[str, object]:
    """A value unlike the default, as a flag/env string and as the field holds it."""
    default = f.metadata["default"]
    if f.metadata["choices"]:
        raw = next(c for c in f.metadata["choices"] if c != default)
        return raw, raw
    if isinstance(default, bool):
        return ("0", False) if default else ("1", True)
    if f.name == "pipeline_depth":  # 1 or 2 only
        return "1", 1
    if isinstance(default, tuple) and default and isinstance(default[0], int):  # sizes (--warm-up-train-rows)
        return "3,5", (3, 5)
    if isinstance(default, tuple):
        return "k1,k2", ("k1", "k2")
    if isinstance(default, int):
        return str(default + 3), default + 3
    if isinstance(default, float):
        return str(default + 1.5), default + 1.5
    if f.name == "state_dir":
        return "/tmp/tf-state", Path("/tmp/tf-state").resolve()
    return "value-" + f.name, "value-" + f.name


def _command_for(f) -> str:
    return next(c for c, groups in COMMAND_GROUPS.items() if f.metadata["group"] in groups)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for f in FIELDS:
        for name in (env_name(f.name), *f.metadata["env_fallbacks"]):
            monkeypatch.delenv(name, raising=False)


def test_every_field_has_a_flag_and_every_flag_a_field():
    flags = _all_flags()
    dests = {a.dest for a in flags.values()}
    for f in FLAGGED:
        assert flag_name(f) in flags and flags[flag_name(f)].dest == f.name, f"{f.name} has no flag"
    for f in FIELDS:
        if f.metadata["group"] in ENV_ONLY:
            assert f.name not in dests, f"{f.name} is env-only but has a flag"
    field_names = {f.name for f in FIELDS}
    for opt, action in flags.items():
        assert action.dest in field_names or opt in NOT_SETTINGS, f"{opt} is no Settings field and not documented"


def test_every_old_flag_name_still_parses():
    assert set(_all_flags()) >= OLD_FLAGS, OLD_FLAGS - set(_all_flags())


def test_each_command_shows_the_groups_it_names():
    for command, p in _commands().items():
        dests = {a.dest for a in _actions(p)}
        for f in FLAGGED:
            assert (f.name in dests) == (f.metadata["group"] in COMMAND_GROUPS.get(command, ())), (command, f.name)


def test_help_names_default_and_env_of_every_flag():
    for command, p in _commands().items():
        text = " ".join(p.format_help().split())
        assert "options:" in text, command
        for f in FLAGGED:
            if f.metadata["group"] in COMMAND_GROUPS.get(command, ()):
                assert flag_name(f) in text and env_name(f.name) in text, (command, f.name)
    assert "TINKERFLOW_API_KEYS" in " ".join(_commands()["api"].format_help().split())
    assert "(default: 8;" in " ".join(_commands()["jax-worker"].format_help().split())


@pytest.mark.parametrize("f", FIELDS, ids=lambda f: f.name)
def test_env_reaches_the_field(f, monkeypatch):
    raw, value = _sample(f)
    monkeypatch.setenv(env_name(f.name), raw)
    s = Settings()
    assert getattr(s, f.name) == value and s.is_given(f.name)
    assert env_setting(f.name) == value


@pytest.mark.parametrize("f", FLAGGED, ids=lambda f: f.name)
def test_flag_reaches_the_field_and_wins_over_env(f, monkeypatch):
    raw, value = _sample(f)
    command = _command_for(f)
    default = f.metadata["default"]
    if isinstance(default, bool):
        argv = [flag_name(f) if value else "--no-" + flag_name(f)[2:]]
        monkeypatch.setenv(env_name(f.name), "1" if not value else "0")
    else:
        argv = [flag_name(f), raw]
        other = default if f.metadata["choices"] else "env" if isinstance(default, tuple) else raw + "0"
        other = "7" if isinstance(default, tuple) and default and isinstance(default[0], int) else other
        other = str(default) if f.name == "pipeline_depth" else other
        monkeypatch.setenv(env_name(f.name), other)
    s = Settings().with_args(build_parser().parse_args([command, *argv]))
    assert getattr(s, f.name) == value and f.name in s.given


def test_aliases_and_repeatable_keys():
    p = build_parser()
    s = Settings().with_args(p.parse_args(["ray", "--hosts", "4", "--strategy", "SPREAD", "--max-restarts", "-1"]))
    assert (s.ray_hosts, s.ray_strategy, s.ray_max_restarts) == (4, "SPREAD", -1)
    s = Settings().with_args(p.parse_args(["api", "--api-key", "a,b", "--api-keys", "c"]))
    assert s.api_keys == ("a", "b", "c")


def test_ray_address_falls_back_to_rays_own_variable(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "head:6379")
    assert Settings().ray_address == "head:6379"
    monkeypatch.setenv("TINKERFLOW_RAY_ADDRESS", "ray://other:10001")
    assert Settings().ray_address == "ray://other:10001"


def test_defaults_are_not_given():
    s = Settings()
    assert not s.given and not s.is_given("temporal_address")
    assert Settings(temporal_address="10.0.0.1:7233").is_given("temporal_address")


@pytest.mark.parametrize(
    "name, raw", [("TINKERFLOW_PORT", "eighty"), ("TINKERFLOW_API_DOCS", "maybe"), ("TINKERFLOW_LOG_LEVEL", "LOUD")]
)
def test_a_bad_variable_is_a_clear_error(name, raw, monkeypatch, capsys):
    monkeypatch.setenv(name, raw)
    with pytest.raises(SettingsError, match=name):
        Settings()
    with pytest.raises(SystemExit) as exit_:
        main(["api"])
    assert exit_.value.code == 2 and name in capsys.readouterr().err


def test_top_level_help_lists_every_command():
    out = subprocess.run(
        [sys.executable, "-m", "tinkerflow.cli.main", "--help"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 0
    for command in (*COMMAND_GROUPS, "make-tiny-model"):
        assert command in out.stdout


# Reads of the environment outside Settings, each for a reason that is not configuration.
ENV_READS_ALLOWED = {
    "platform/common/settings.py": "the one reader",
    "platform/cli/up.py": "children inherit the environment (plus the resolved settings)",
    "platform/cli/launch.py": "the test stack's `up` gets the caller's environment less TINKERFLOW_*",
    "platform/cli/ray_local.py": "a local Ray head gets the environment less TINKERFLOW_*/RAY_*, and PATH",
    "platform/cli/ray_plan.py": "actors inherit the driver's HF_HUB_OFFLINE (a Hugging Face variable)",
    "platform/cli/ray_actor.py": "sets (never reads) the actor's environment before JAX is imported",
}
ENV_READ = re.compile(r"os\.environ|os\.getenv|getenv\(")


def test_no_code_reads_the_environment_behind_settings():
    found = []
    for folder in ("platform", "workers", "activities", "workflows"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in ENV_READS_ALLOWED:
                continue
            found += [f"{rel}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1) if ENV_READ.search(line)]
    assert found == []


def test_as_env_carries_every_field_to_a_child_process(monkeypatch, tmp_path):
    """What `up` hands its parts: every field reads back the same from the variables (nothing left at a default)."""
    # Any: each sample is typed `object` by _sample, but is built to match its own field's type.
    values: dict[str, Any] = {f.name: _sample(f)[1] for f in FIELDS}
    values["state_dir"] = tmp_path
    parent = Settings(**values)
    env = parent.as_env()
    assert set(env) == {env_name(f.name) for f in FLAGGED}  # the env-only ones travel as inherited variables
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    child = Settings()
    for f in FLAGGED:
        expected = getattr(parent, f.name)
        if f.name == "store_url":
            expected = parent.resolved_store_url
        elif f.name == "checkpoint_root":
            expected = parent.resolved_checkpoint_root
        assert getattr(child, f.name) == expected, f.name
    monkeypatch.setenv("TINKERFLOW_STORE_URL", "")
    assert Settings(state_dir=tmp_path, store_url="").as_env()["TINKERFLOW_STORE_URL"] == (tmp_path / "store").as_uri()


def test_up_passes_its_settings_to_its_parts(tmp_path):
    from tinkerflow.cli.up import child_env

    s = Settings(state_dir=tmp_path, port=8123, api_keys=("a", "b"), api_docs=True)
    env = child_env(s)
    assert (env["TINKERFLOW_PORT"], env["TINKERFLOW_API_KEYS"], env["TINKERFLOW_API_DOCS"]) == ("8123", "a,b", "1")
    assert env["TINKERFLOW_STATE_DIR"] == str(tmp_path) and "HF_HUB_OFFLINE" in env


def test_a_fault_hook_set_after_the_settings_were_made_still_reaches_the_parts(tmp_path, monkeypatch):
    from tinkerflow.cli.up import child_env

    s = Settings(state_dir=tmp_path)  # made first, as the durability tests' stack is
    monkeypatch.setenv("TINKERFLOW_FAULT_PAUSE_BEFORE_COMMIT_S", "120")
    assert child_env(s)["TINKERFLOW_FAULT_PAUSE_BEFORE_COMMIT_S"] == "120"


def test_a_pipeline_depth_the_coordinator_cannot_use_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("TINKERFLOW_PIPELINE_DEPTH", "3")
    with pytest.raises(SettingsError, match=r"pipeline_depth .*1 .*or 2"):
        Settings()
