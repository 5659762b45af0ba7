"""The fuzzed wire runs against the real stack, never a mock: the e2e fixtures, and a run whose seq_ids the fuzzer
owns. Fast profile by default; `TINKERFLOW_FUZZ=long` (or `-m slow`) runs the long one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from tests.e2e.conftest import (  # noqa: F401  (fixtures, and the hook that shows the stack's logs on a failure)
    base_model,
    metrics_ports,
    pytest_runtest_makereport,
    service_client,
    stack,
    training_client,
)

_COMMON: dict[str, Any] = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
# fast: few examples, derandomized (CI sees the same inputs every run); long: many, random (run it to hunt).
settings.register_profile("fast", max_examples=12, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=int(os.environ.get("TINKERFLOW_FUZZ_EXAMPLES", "400")), **_COMMON)


def _long(config) -> bool:
    return os.environ.get("TINKERFLOW_FUZZ") == "long" or "slow" in (config.getoption("markexpr") or "")


def pytest_configure(config) -> None:
    settings.load_profile("long" if _long(config) else "fast")


def pytest_collection_modifyitems(config, items):
    """`@pytest.mark.slow` fuzz tests run only in the long profile."""
    if _long(config):
        return
    here = Path(__file__).parent
    for item in items:
        if "slow" in item.keywords and Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.skip(reason="long fuzz profile: TINKERFLOW_FUZZ=long or -m slow"))
