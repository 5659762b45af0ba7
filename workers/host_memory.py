"""Host memory of a long-lived JAX worker: its memory mappings against the kernel's `vm.max_map_count`, and its
compiled programs (docs/metrics.md, docs/operations.md §Host settings for a long-lived JAX worker).

XLA's CPU backend JIT-compiles every program with LLVM and maps each piece of its code on its own, so every
executable held costs the process a few hundred memory mappings. Linux caps a process's mappings at
`vm.max_map_count` (65,530 by default); past it an `mmap` fails, LLVM reports "Cannot allocate memory" and the worker
dies (a CPU worker did, after 500 programs in 43 minutes). The program budget (engine/runtime/program_budget.py)
bounds the programs held; at start `check_map_count` warns when the kernel's limit is too low for that budget, and
/metrics exports the mapping count so the margin can be watched.

Measured (tiny Qwen3 engine on CPU, jax 0.10.2): a warm-up of 27 AotCache programs (train steps, forward steps and
sampler programs, with the 16 smaller programs JAX built beside them) added 10,447 mappings, 387 per AotCache
program, and dropping the 27 gave 9,800 back; the default `--warm-up ready` plan built 72 programs and added 28,208
mappings, 392 each. A toy jitted function holds 24. On GPU and TPU the code goes to the device and was
not measured here, so the check applies to CPU only; the gauge is exported everywhere.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from functools import partial

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tinkerflow.workers.engine.runtime.program_budget import (
    BASE_MAPPINGS,
    BUDGET,
    MAPPINGS_PER_PROGRAM,
    MAX_MAP_COUNT,  # noqa: F401 (the limit's path, named here beside the maps' for callers and tests)
    default_max_programs,
    max_map_count,
)

log = logging.getLogger(__name__)

MAPS = "/proc/self/maps"
# The fix to print: enough for the default budget (512 programs: 266,000) with room to spare.
RECOMMENDED_MAX_MAP_COUNT = 524_288


def memory_mappings(path: str = MAPS) -> int | None:
    """The process's memory mappings now (lines of /proc/self/maps, counted in binary chunks: at 200,000 mappings the
    file is about 20 MB), or None where there is no such file (not Linux)."""
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(partial(f.read, 1 << 20), b""))
    except OSError:
        return None


def mappings_needed(max_programs: int) -> int:
    return BASE_MAPPINGS + MAPPINGS_PER_PROGRAM * max_programs


def check_map_count(max_programs: int, backend: str, limit: int | None = None) -> str | None:
    """At start: warn (and return the warning) when `vm.max_map_count` is below what `max_programs` programs may
    map on this backend; None when it is enough, unknown, or the backend is not CPU (see the module docstring)."""
    if backend != "cpu":
        return None
    limit = max_map_count() if limit is None else limit
    needed = mappings_needed(max_programs)
    if limit is None or limit >= needed:
        return None
    raise_to = max(RECOMMENDED_MAX_MAP_COUNT, -(-needed // 65536) * 65536)
    fits = max(1, (limit - BASE_MAPPINGS) // MAPPINGS_PER_PROGRAM)
    message = (
        f"vm.max_map_count is {limit:,}, below the ~{needed:,} memory mappings this JAX worker may hold with "
        f"--max-programs {max_programs} (about {MAPPINGS_PER_PROGRAM} per compiled program on CPU, plus "
        f"{BASE_MAPPINGS:,}): past the limit XLA fails with 'Cannot allocate memory' and the worker dies. Raise it on "
        f"the host: `sysctl -w vm.max_map_count={raise_to}` (as root; persist it in /etc/sysctl.d/). On Kubernetes it "
        "is a node setting: the node pool's sysctl configuration, or a privileged init container or DaemonSet that "
        f"runs that command (docs/operations.md §Host settings for a long-lived JAX worker). Or lower --max-programs "
        f"to {fits}."
    )
    log.warning(message)
    return message


def bound_programs(max_programs: int, max_bytes: int) -> None:
    """At a JAX worker process's start (every process of a multi-host worker: each holds its own programs), before
    anything compiles: the program budget (`max_programs` 0: `default_max_programs`), `check_map_count` for it, and
    the series below on /metrics."""
    import jax

    backend = jax.default_backend()
    if max_programs <= 0:
        max_programs = default_max_programs(backend, max_map_count())
        log.info("program budget: %d compiled programs (--max-programs auto, vm.max_map_count)", max_programs)
    BUDGET.configure(max_programs, max_bytes)
    check_map_count(max_programs, jax.default_backend())
    register_metrics()


class HostMemoryCollector(Collector):
    """The JAX worker's host-memory series, read when Prometheus scrapes (never on the engine's path)."""

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        mappings, limit = memory_mappings(), max_map_count()
        if mappings is not None:
            yield GaugeMetricFamily(
                "tinkerflow_worker_memory_mappings", "memory mappings of the JAX worker process", value=mappings
            )
        if limit is not None:
            yield GaugeMetricFamily(
                "tinkerflow_worker_max_map_count", "the kernel's limit on one process's mappings", value=limit
            )
        s = BUDGET.stats()
        yield GaugeMetricFamily("tinkerflow_worker_programs_compiled", "compiled programs held", value=s.held)
        yield GaugeMetricFamily(
            "tinkerflow_worker_program_bytes",
            "code bytes of the compiled programs held (estimated on CPU)",
            value=s.held_bytes,
        )
        yield GaugeMetricFamily(
            "tinkerflow_worker_max_programs", "the program budget (--max-programs)", value=s.max_programs
        )
        yield CounterMetricFamily(
            "tinkerflow_worker_program_compiles", "programs compiled (recompiles included)", value=s.compiles
        )
        yield CounterMetricFamily(
            "tinkerflow_worker_program_evictions", "programs dropped past the program budget", value=s.evictions
        )
        yield CounterMetricFamily(
            "tinkerflow_worker_program_recompiles",
            "programs compiled again after they were dropped",
            value=s.recompiles,
        )
        yield CounterMetricFamily(
            "tinkerflow_worker_program_compile_seconds", "wall time spent compiling programs", value=s.compile_seconds
        )


# Registries the collector is on: an engine may be loaded more than once in a process (tests), and a registry refuses
# a second collector with the same series.
_registered: weakref.WeakSet[CollectorRegistry] = weakref.WeakSet()


def register_metrics(registry: CollectorRegistry = REGISTRY) -> None:
    """Export the series above on `registry` (once per registry)."""
    if registry not in _registered:
        registry.register(HostMemoryCollector())
        _registered.add(registry)
