"""The JAX worker's host memory (workers/host_memory.py): its mapping count is read from /proc, the start-up check
warns with the numbers and the sysctl fix when vm.max_map_count is too low for the program budget and says nothing
otherwise, and /metrics carries the mapping and program series."""

from __future__ import annotations

import logging
import sys

import jax
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from tinkerflow.workers import host_memory
from tinkerflow.workers.engine.runtime.program_budget import BUDGET

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")


@linux
def test_the_mapping_count_is_the_lines_of_proc_self_maps():
    with open("/proc/self/maps") as f:
        lines = len(f.readlines())
    n = host_memory.memory_mappings()
    assert n is not None and n > 0
    assert abs(n - lines) < 100  # another thread may map or unmap between the two reads
    assert (host_memory.max_map_count() or 0) > 0


def test_without_proc_there_is_nothing_to_read(tmp_path):
    assert host_memory.memory_mappings(str(tmp_path / "none")) is None
    assert host_memory.max_map_count(str(tmp_path / "none")) is None


def test_a_low_max_map_count_warns_with_the_numbers_and_the_fix(monkeypatch, caplog):
    monkeypatch.setattr(host_memory, "max_map_count", lambda path=host_memory.MAX_MAP_COUNT: 65530)
    with caplog.at_level(logging.WARNING, logger=host_memory.__name__):
        message = host_memory.check_map_count(512, "cpu")
    assert message is not None and [r.getMessage() for r in caplog.records] == [message]
    needed = host_memory.BASE_MAPPINGS + host_memory.MAPPINGS_PER_PROGRAM * 512
    assert "65,530" in message and f"{needed:,}" in message and "--max-programs 512" in message
    assert "sysctl -w vm.max_map_count=524288" in message
    assert (
        f"lower --max-programs to {(65530 - host_memory.BASE_MAPPINGS) // host_memory.MAPPINGS_PER_PROGRAM}" in message
    )
    # A budget 524,288 cannot hold: the fix names a limit that can.
    big = host_memory.check_map_count(1100, "cpu", limit=65530)
    assert big is not None and "sysctl -w vm.max_map_count=589824" in big


def test_a_high_or_unknown_limit_or_another_backend_says_nothing(monkeypatch, caplog):
    with caplog.at_level(logging.WARNING, logger=host_memory.__name__):
        assert host_memory.check_map_count(512, "cpu", limit=524288) is None
        monkeypatch.setattr(host_memory, "max_map_count", lambda path=host_memory.MAX_MAP_COUNT: None)
        assert host_memory.check_map_count(512, "cpu") is None  # not Linux
        assert host_memory.check_map_count(512, "gpu", limit=65530) is None  # not measured there
    assert caplog.records == []


def test_the_worker_start_sets_the_budget_and_checks_it(monkeypatch, caplog):
    monkeypatch.setattr(host_memory, "max_map_count", lambda path=host_memory.MAX_MAP_COUNT: 1000)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")  # the check's backend, whatever runs the tests
    limits = BUDGET.limits()
    try:
        with caplog.at_level(logging.WARNING, logger=host_memory.__name__):
            host_memory.bound_programs(limits[0] + 1, limits[1])
        assert BUDGET.stats().max_programs == limits[0] + 1
        assert any("vm.max_map_count is 1,000" in r.getMessage() for r in caplog.records)
    finally:
        BUDGET.configure(*limits)


@linux
def test_metrics_carry_the_mappings_and_the_programs():
    registry = CollectorRegistry()
    host_memory.register_metrics(registry)
    host_memory.register_metrics(registry)  # once per registry, however often the engine is loaded
    text = generate_latest(registry).decode()
    values = {
        line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and not line.startswith("#")
    }
    assert values["tinkerflow_worker_memory_mappings"] > 0
    assert values["tinkerflow_worker_max_map_count"] > 0
    for name in (
        "tinkerflow_worker_programs_compiled",
        "tinkerflow_worker_program_bytes",
        "tinkerflow_worker_max_programs",
        "tinkerflow_worker_program_compiles_total",
        "tinkerflow_worker_program_evictions_total",
        "tinkerflow_worker_program_recompiles_total",
        "tinkerflow_worker_program_compile_seconds_total",
    ):
        assert name in values, name


def test_the_automatic_bound_leaves_the_mappings_room_on_cpu_and_is_the_ceiling_elsewhere():
    assert host_memory.default_max_programs("cpu", 65_530) == (65_530 - 10_000) // 500 == 111
    assert host_memory.default_max_programs("cpu", 524_288) == 512  # at most the ceiling
    assert host_memory.default_max_programs("cpu", 1_000) == 16  # a floor: a worker that can run at all
    assert host_memory.default_max_programs("gpu", 65_530) == host_memory.default_max_programs("cpu", None) == 512
