"""tinker-cookbook 0.6.1's own entry points, unmodified, against the real stack (tests/e2e/conftest.py `stack`).

Installed by the `cookbook` extra (scripts/setup.sh test,parity,cookbook); skipped where it is not installed.
Each test reads back what the loop wrote (metrics.jsonl, checkpoints.jsonl) rather than only that it ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def require_cookbook() -> None:
    pytest.importorskip("tinker_cookbook", reason="the cookbook extra is not installed (scripts/setup.sh …,cookbook)")


@pytest.fixture
def cookbook_env(stack, monkeypatch):
    """What a user sets before running a recipe against `tinkerflow up`."""
    monkeypatch.setenv("TINKER_API_KEY", stack.api_key)
    monkeypatch.setenv("TINKER_BASE_URL", stack.base_url)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return stack


def read_metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def read_checkpoints(log_path: Path) -> list[dict]:
    path = log_path / "checkpoints.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def assert_steps_contiguous_from_zero(rows: list[dict]) -> list[int]:
    steps = [r["step"] for r in rows if "step" in r]
    train_steps = sorted(set(steps))
    assert train_steps == list(range(len(train_steps))), f"steps not contiguous from 0: {steps}"
    return train_steps


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.slow` cookbook tests (the long RL matrix) run only with `-m slow` or TINKERFLOW_SLOW_TESTS=1,
    as the engine's slow tests do: `bash scripts/test.sh -m slow tests/e2e/cookbook` runs all of them."""
    import os

    if os.environ.get("TINKERFLOW_SLOW_TESTS") == "1" or "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow cookbook test: run with -m slow or TINKERFLOW_SLOW_TESTS=1")
    here = Path(__file__).parent
    for item in items:
        if "slow" in item.keywords and Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(skip)
