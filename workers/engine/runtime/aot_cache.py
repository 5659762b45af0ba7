"""Ahead-of-time compilation per bucket shape, so every compile is timed and logged once (at INFO)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Hashable
from functools import partial
from typing import Any

import jax

from .program_budget import BUDGET, ProgramBudget, program_bytes

log = logging.getLogger(__name__)


def warmed_bucket(bucket: int, warmed: Collection[int], limit: int | None = None) -> int:
    """The smallest warmed bucket >= `bucket` (and <= `limit`), else `bucket` itself: padding a little more is
    cheaper than compiling in the middle of a workload (warm_up.py records what it warmed)."""
    return min((w for w in warmed if bucket <= w and (limit is None or w <= limit)), default=bucket)


def _shape_key(args: tuple) -> Hashable:
    leaves, treedef = jax.tree.flatten(args)
    return treedef, tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x)))) for x in leaves)


def _program_key(args: tuple, static: dict[str, Any]) -> Hashable:
    """Which program these arguments and static settings run: one executable per key."""
    return _shape_key(args), tuple(sorted(static.items()))


class AotCache:
    """Compiles `fn` once per (static kwargs, argument shapes and dtypes) and reuses the executable.

    `donate` names arguments whose buffers the step may reuse (gradient accumulators, decode state).

    `prepare` may be called from several threads at once (the warm-up compiles several shapes side by side: XLA
    releases the GIL while it compiles): each shape is compiled once, a second caller of a shape being compiled
    waits for that compile, and compiles of different shapes do not wait for each other.

    The executables are held under the process's program budget (program_budget.py): past `--max-programs` (or
    `--program-memory-mb`) the least recently used of all caches is dropped and built again when next needed, so a
    long tail of shapes cannot exhaust the host's memory mappings (`budget`: the process's; a test passes its own).
    `compiles` counts every build (recompiles included); `compiled_count` is what is held now.
    """

    def __init__(self, name: str, fn: Callable, donate: tuple[str, ...] = (), budget: ProgramBudget = BUDGET):
        self.name = name
        self._fn = fn
        self._donate = donate
        self._compiled: dict[Hashable, Callable] = {}
        # XLA's memory analysis of each executable, read once: it is fixed per program, and reading it costs about
        # as much CPU as a small step (it is asked before every micro-batch the memory plan admits).
        self._needed: dict[Hashable, int] = {}
        self.compile_seconds: dict[str, float] = {}
        # Programs built since this cache was made, recompiles after an eviction included: what a caller that asks
        # "did this compile anything?" compares (len(_compiled) can fall while programs are built).
        self.compiles = 0
        self._lock = threading.Lock()  # guards _building
        self._building: dict[Hashable, threading.Lock] = {}  # one lock per shape, held while it compiles
        self._token = budget.register(self)
        self._budget = budget

    @property
    def compiled_count(self) -> int:
        """Executables held now (the budget may have dropped some of those built)."""
        return len(self._compiled)

    def drop(self, key: Hashable) -> None:
        """Forget one executable (the budget's eviction; a caller running it keeps its own reference until done).
        Its `_needed` stays: a small int, and the memory plan reads it without building the program again."""
        self._compiled.pop(key, None)

    def clear(self) -> None:
        """Forget every executable, so the next call of each shape compiles (benchmarks that change the
        environment between runs)."""
        self._budget.forget(self._token)
        self._compiled.clear()

    def prepare(self, label: str, *args: Any, **static: Any) -> Callable:
        """The executable for these arguments' shapes, compiled now if it was not yet; nothing runs (a warm-up can
        pass the live state, or `abstract` of it: it is only read for its shapes and shardings, never donated)."""
        key = _program_key(args, static)
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._budget.touch(self._token, key)
            return compiled
        with self._lock:
            building = self._building.setdefault(key, threading.Lock())
        with building:
            compiled = self._compiled.get(key)  # compiled by another thread while this one waited
            if compiled is None:
                t0 = time.perf_counter()
                jitted = jax.jit(partial(self._fn, **static), donate_argnames=self._donate)
                compiled = jitted.lower(*args).compile()
                seconds = time.perf_counter() - t0
                desc = f"{label} {static}" if static else label
                self.compile_seconds[desc] = seconds
                # Read once, here: the budget weighs the program by its code, the memory plan asks what it needs.
                stats = _memory_analysis(compiled)
                self._needed.setdefault(key, _needed_bytes(stats))
                self._compiled[key] = compiled
                self.compiles += 1
                again = self._budget.admit(self, self._token, key, program_bytes(stats), seconds)
                note = " (again: the program budget had dropped it)" if again else ""
                log.info("compiled %s for %s in %.2fs%s", self.name, desc, seconds, note)
        return compiled

    def needed_bytes(self, label: str, *args: Any, **static: Any) -> int:
        """Device memory the program for these arguments allocates beyond its arguments (XLA's temporaries and the
        outputs that do not reuse a donated input), compiling it if it was not yet; 0 where the backend cannot say."""
        key = _program_key(args, static)
        needed = self._needed.get(key)
        if needed is None:
            self.prepare(label, *args, **static)
            needed = self._needed[key]  # read as `prepare` built the program, before it could return it
        return needed

    def __call__(self, label: str, *args: Any, **static: Any) -> Any:
        return self.prepare(label, *args, **static)(*args)


def _memory_analysis(compiled: Any) -> Any:
    """XLA's memory analysis of an executable, or None where the backend has none (it answers None, or raises)."""
    try:
        return compiled.memory_analysis()
    except Exception:  # noqa: BLE001 (a backend without the analysis raises its own error type: weigh it as unknown)
        return None


def _needed_bytes(stats: Any) -> int:
    if stats is None:
        return 0
    return max(0, stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes)


def abstract(tree: Any) -> Any:
    """Shapes, dtypes and shardings of `tree`'s arrays without their buffers: what `AotCache.prepare` needs, safe to
    hand to another thread while this one goes on using (and donating) the arrays."""

    def spec(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding, weak_type=x.weak_type)

    return jax.tree.map(spec, tree)
