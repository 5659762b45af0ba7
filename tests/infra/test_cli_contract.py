"""Every flag, TINKERFLOW_* variable and port the manifests use is one the `tinkerflow` CLI accepts."""

from __future__ import annotations

import argparse
import re

import pytest

from tests.infra.conftest import INFRA, OVERLAYS, by_kind, pod_specs, render

# Variables the manifests may set before the code reads them (none today: the multi-host JAX worker's and the
# Temporal Cloud mTLS variables have landed). An entry here must not be a Settings field.
PLANNED_ENV: dict[str, str] = {}
# Variables the code reads that are no Settings field (none: every one goes through Settings).
EXTRA_ENV: set[str] = set()


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from tinkerflow.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in p._actions for opt in a.option_strings}


def known_env() -> set[str]:
    from tinkerflow.common.settings import config_fields, env_name

    return {env_name(f.name) for f in config_fields()} | EXTRA_ENV


def test_settings_env_names_are_what_the_brief_lists():
    assert {
        "TINKERFLOW_API_KEYS",
        "TINKERFLOW_BASE_MODEL",
        "TINKERFLOW_STORE_URL",
        "TINKERFLOW_TEMPORAL_ADDRESS",
        "TINKERFLOW_STATE_DIR",
        "TINKERFLOW_PORT",
        "TINKERFLOW_HOST",
    } <= known_env()
    assert not (set(PLANNED_ENV) & known_env()), "a planned variable has landed: drop it from PLANNED_ENV"


def _check_args(args: list[str], where: str) -> None:
    commands = _subcommands()
    assert args and args[0] in {"api", "workflow-worker", "jax-worker"}, f"{where}: {args}"
    flags = _flags(commands[args[0]])
    i = 1
    while i < len(args):
        token = args[i]
        assert token.startswith("--"), f"{where}: unexpected positional {token!r}"
        name = token.split("=", 1)[0]
        assert name in flags, f"{where}: `tinkerflow {args[0]}` has no flag {name}"
        takes_value = flags[name].nargs != 0 and "=" not in token
        i += 2 if takes_value else 1
    # The whole line parses.
    commands[args[0]].parse_args(args[1:])


def test_container_commands_and_flags_exist(overlay):
    for owner, spec in pod_specs(render(overlay)):
        for c in spec["containers"]:
            assert "command" not in c, f"{owner}: keep the image's ENTRYPOINT (tinkerflow)"
            _check_args(c["args"], owner)


def test_env_names_are_settings_or_planned(overlay):
    objects = render(overlay)
    used: dict[str, str] = {}
    for cm in by_kind(objects, "ConfigMap"):
        used.update({k: f"ConfigMap/{cm['metadata']['name']}" for k in cm.get("data", {})})
    for secret in by_kind(objects, "Secret"):
        used.update(
            {
                k: f"Secret/{secret['metadata']['name']}"
                for k in {**secret.get("data", {}), **secret.get("stringData", {})}
            }
        )
    for owner, spec in pod_specs(objects):
        for c in spec["containers"]:
            used.update({e["name"]: owner for e in c.get("env", [])})
    allowed = known_env() | set(PLANNED_ENV)
    for name, where in used.items():
        if name.startswith("TINKERFLOW_"):
            assert name in allowed, f"{where}: {name} is neither a Settings field nor a planned variable"


def test_configmap_values_parse_as_the_cli_would(overlay):
    """Numbers are numbers, the log level is one argparse accepts."""
    cm = next(o for o in render(overlay) if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "tinkerflow-config")
    data = cm["data"]
    for key in ("TINKERFLOW_MAX_LORA_ADAPTERS", "TINKERFLOW_MAX_LORA_RANK", "TINKERFLOW_MAX_QUEUED_SAMPLES"):
        int(data[key])
    for key in ("TINKERFLOW_SESSION_TIMEOUT_S", "TINKERFLOW_LONG_POLL_S"):
        float(data[key])
    level = _flags(_subcommands()["api"])["--log-level"]
    assert data["TINKERFLOW_LOG_LEVEL"] in level.choices
    assert re.fullmatch(r"[^:]+:\d+", data["TINKERFLOW_TEMPORAL_ADDRESS"])


def test_api_port_is_the_cli_default():
    from tinkerflow.common.settings import Settings

    port = Settings().port
    for overlay in OVERLAYS:
        dep = next(
            o for o in render(overlay) if o["kind"] == "Deployment" and o["metadata"]["name"] == "tinkerflow-api"
        )
        assert dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == port


def test_ready_file_flag_used_by_probes_is_the_one_passed():
    """Worker probes look for the file the worker was told to touch (--ready-file, the flag `tinkerflow up` uses)."""
    for overlay in OVERLAYS:
        for owner, spec in pod_specs(render(overlay)):
            c = spec["containers"][0]
            if "--ready-file" not in c["args"]:
                continue
            path = c["args"][c["args"].index("--ready-file") + 1]
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                cmd = c[probe]["exec"]["command"]
                assert cmd[:2] == ["python", "/usr/local/lib/tinkerflow/probe.py"], owner
                assert cmd[cmd.index("ready") + 1] == path, f"{owner} {probe}"


@pytest.mark.parametrize("path", sorted(str(p.relative_to(INFRA)) for p in (INFRA / "docker").glob("Dockerfile")))
def test_dockerfile_env_names_are_settings(path):
    text = (INFRA / path).read_text()
    for name in set(re.findall(r"\b(TINKERFLOW_[A-Z_]+)=", text)):
        assert name in known_env(), name
