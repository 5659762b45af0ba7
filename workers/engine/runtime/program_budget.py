"""The process-wide budget of compiled XLA programs: the executables of every `AotCache` in one LRU, bounded by a count
and by bytes of generated code, so a long tail of shapes cannot make a long-lived worker hold programs without end.

Why: every executable holds host memory and, on CPU, memory mappings (XLA's CPU backend JIT-compiles with LLVM and
puts each piece of a program's code in mappings of its own: about 390 per engine program of the tiny Qwen3, measured,
workers/host_memory.py). A CPU worker that compiled 500 programs in 43 minutes reached the kernel's vm.max_map_count
(65,530 by default), LLVM failed with "Cannot allocate memory" and the worker died of SIGSEGV. Dropping an executable
unmaps its code (measured too: 27 programs dropped gave back 9,800 of their 10,400 mappings).

Past either bound the least recently used program (of any cache) is dropped: the next call that needs it compiles it
again, or reads it back from the persistent compilation cache when that is on. The program just built is never the
one dropped, so a single program over the byte bound still runs. The bounds come from `--max-programs` and
`--program-memory-mb` (Settings; the JAX worker applies them with `configure` before its engine compiles anything;
elsewhere, tests and benchmarks, they are read from the environment at first use).

The counters (compiles, evictions, recompiles: a program built again after it was dropped, compile seconds) are the
process's since start; the JAX worker exports them on /metrics (workers/host_memory.py, docs/metrics.md).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

# What a program counts for the byte bound where the backend reports no code size (JAX's CPU backend reports 0):
# dropping the 27 programs of a tiny engine gave back 59 MiB of mappings, about 2.2 MiB each; twice that, so a CPU
# worker's byte bound (4 GiB by default) comes after its count bound (512 x 4 MiB = 2 GiB), which is what guards
# its mappings.
UNKNOWN_PROGRAM_BYTES = 4 * 2**20
# Evicted programs remembered (by hash) to count recompiles: a long tail evicts without end, so the memory of it is
# bounded too (about 60 bytes an entry); forgetting only makes a later recompile count as a first compile.
_EVICTED_REMEMBERED = 65536


MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
# Mappings one compiled program holds on CPU: 370 to 392 measured per engine program, but a worker with the old
# sampler died of "Unable to allocate section memory" after 120 programs (benchmarks/program_count.py), where 400 each
# would have left room for 138: the small programs JAX builds beside them count too. 500 keeps that margin.
MAPPINGS_PER_PROGRAM = 500
# Mappings of everything else: the interpreter and its libraries, the weights, JAX's own small programs (745 for the
# tiny engine before its first program; a real model's libraries and files add some thousands).
BASE_MAPPINGS = 10_000


def max_map_count(path: str = MAX_MAP_COUNT) -> int | None:
    """The kernel's vm.max_map_count, or None where it cannot be read (not Linux)."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def default_max_programs(backend: str, limit: int | None, ceiling: int = 512) -> int:
    """The program count bound when --max-programs is 0 (auto): on CPU, what `limit` (vm.max_map_count) leaves room
    for, so a worker that meets a long tail of shapes drops programs instead of dying; elsewhere, or where the
    limit is unknown, `ceiling`. At most `ceiling` and at least 16."""
    if backend != "cpu" or limit is None:
        return ceiling
    return max(16, min(ceiling, (limit - BASE_MAPPINGS) // MAPPINGS_PER_PROGRAM))


class Owner(Protocol):
    """A holder of executables (AotCache): `drop` forgets one, called with the budget's lock held."""

    def drop(self, key: Hashable) -> None: ...


@dataclass(frozen=True)
class ProgramStats:
    held: int  # executables held now
    held_bytes: int  # their generated code (UNKNOWN_PROGRAM_BYTES each where the backend does not say)
    compiles: int  # programs built since start, recompiles included
    evictions: int  # programs dropped past a bound
    recompiles: int  # programs built again after they were dropped
    compile_seconds: float  # wall time of all those builds
    max_programs: int
    max_bytes: int  # 0: no byte bound


def program_bytes(stats: Any) -> int:
    """The bytes a program counts for, from its `memory_analysis()` (None where the backend has none)."""
    code = 0 if stats is None else stats.generated_code_size_in_bytes + stats.host_generated_code_size_in_bytes
    return code if code > 0 else UNKNOWN_PROGRAM_BYTES


class ProgramBudget:
    """One LRU of (owner, key) -> bytes over every owner's executables; the owners keep the executables themselves.

    Thread-safe: owners admit and touch from any thread (AotCache compiles on several). Owners are held weakly, so an
    engine that is dropped (tests make many) takes its programs with it: its entries leave the LRU at the next admit.
    """

    def __init__(self, max_programs: int | None = None, max_bytes: int | None = None):
        self._lock = threading.Lock()
        self._lru: OrderedDict[tuple[int, Hashable], tuple[weakref.ref[Any], int]] = OrderedDict()
        self._bytes = 0
        self._limits = None if max_programs is None else (max_programs, max_bytes or 0)
        self._tokens = itertools.count()
        # Owners collected since the last admit: a finalizer may run on any thread, even one holding the lock, so it
        # only appends here (atomic) and the entries are dropped under the lock later.
        self._gone: list[int] = []
        self._evicted: set[int] = set()
        self._compiles = self._evictions = self._recompiles = 0
        self._compile_seconds = 0.0

    def configure(self, max_programs: int, max_bytes: int) -> None:
        """Set the bounds (`max_bytes` 0: none), dropping what is over them now."""
        if max_programs < 1:
            raise ValueError(f"max_programs must be at least 1, not {max_programs}")
        with self._lock:
            self._limits = (max_programs, max(0, max_bytes))
            self._shrink(keep=None)

    def limits(self) -> tuple[int, int]:
        if self._limits is None:  # not configured: the settings as the environment gives them (tests, benchmarks)
            from tinkerflow.common.settings import env_setting

            count = int(env_setting("max_programs")) or default_max_programs(_backend(), max_map_count())
            self._limits = (count, int(env_setting("program_memory_mb")) * 2**20)
        return self._limits

    def register(self, owner: Owner) -> int:
        """A token for `owner`'s entries; they leave the budget when `owner` is collected."""
        token = next(self._tokens)
        weakref.finalize(owner, self._gone.append, token)
        return token

    def touch(self, token: int, key: Hashable) -> None:
        """`key` of `token` was used: the most recently used now (a no-op if it was dropped meanwhile)."""
        with self._lock:
            try:
                self._lru.move_to_end((token, key))
            except KeyError:
                pass

    def admit(self, owner: Owner, token: int, key: Hashable, nbytes: int, seconds: float) -> bool:
        """`owner` holds a new executable for `key` (built in `seconds`): count it, and drop the least recently used
        programs past the bounds. True when this program had been dropped before (a recompile)."""
        entry = (token, key)
        with self._lock:
            self._purge()
            again = hash(entry) in self._evicted
            if again:
                self._evicted.discard(hash(entry))
                self._recompiles += 1
            old = self._lru.pop(entry, None)
            if old is not None:
                self._bytes -= old[1]
            self._lru[entry] = (weakref.ref(owner), nbytes)
            self._bytes += nbytes
            self._compiles += 1
            self._compile_seconds += seconds
            self._shrink(keep=entry)
        return again

    def forget(self, token: int) -> None:
        """Drop `token`'s entries from the count without counting evictions (its owner cleared itself)."""
        with self._lock:
            self._forget(token)

    def stats(self) -> ProgramStats:
        max_programs, max_bytes = self.limits()
        with self._lock:
            self._purge()
            return ProgramStats(
                held=len(self._lru),
                held_bytes=self._bytes,
                compiles=self._compiles,
                evictions=self._evictions,
                recompiles=self._recompiles,
                compile_seconds=self._compile_seconds,
                max_programs=max_programs,
                max_bytes=max_bytes,
            )

    # ------------------------------------------------------------------ under the lock

    def _shrink(self, keep: tuple[int, Hashable] | None) -> None:
        max_programs, max_bytes = self.limits()
        while self._lru and (len(self._lru) > max_programs or (max_bytes and self._bytes > max_bytes)):
            entry = next(iter(self._lru))
            if entry is keep:  # alone over the byte bound: the program just built stays, it is about to run
                break
            ref, nbytes = self._lru.pop(entry)
            self._bytes -= nbytes
            owner = ref()
            if owner is None:  # collected, its finalizer not yet seen: nothing to drop, nor to count
                continue
            owner.drop(entry[1])
            self._evictions += 1
            if len(self._evicted) >= _EVICTED_REMEMBERED:
                self._evicted.clear()
            self._evicted.add(hash(entry))

    def _purge(self) -> None:
        while self._gone:
            self._forget(self._gone.pop())

    def _forget(self, token: int) -> None:
        for entry in [e for e in self._lru if e[0] == token]:
            self._bytes -= self._lru.pop(entry)[1]


# The one budget of this process: every AotCache admits its executables here.
BUDGET = ProgramBudget()


def _backend() -> str:
    import jax

    return jax.default_backend()
