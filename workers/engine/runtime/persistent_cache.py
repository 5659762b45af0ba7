"""XLA's persistent compilation cache for the JAX worker, and counters of what it saved.

A JAX worker compiles its train step, optimizer step and every sampler bucket it meets; on 2 CPU cores that is tens
of seconds, and it is paid again by every restart (supervised crash, `kill -9`, a second `tinkerflow up`, a Ray actor
brought back). JAX can keep compiled executables on disk keyed by the program, the compiler options and the backend,
so a restarted worker deserialises instead of compiling. We keep everything (no minimum compile time or entry size):
the tiny programs of a small model are exactly the ones a user waits for at the first request.

The counters come from JAX's own monitoring events, so a test (or the worker's log) can say "this process compiled
nothing": `misses` counts programs XLA really compiled, `hits` those read back from disk, and `requests` every program
the process had to build at all (compiled or read back; counted whether or not the cache is on): after a warm-up, a
steady workload adds none.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import jax
from jax import monitoring

log = logging.getLogger(__name__)

_HIT = "/jax/compilation_cache/cache_hits"
_MISS = "/jax/compilation_cache/cache_misses"
# Timed around every backend compile JAX asks for (a persistent-cache hit included), whatever the cache setting.
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@dataclass(frozen=True)
class CacheCounts:
    hits: int
    misses: int
    requests: int = 0  # programs built by this process: compiled, or read back from the persistent cache


class _Counter:
    """Process-wide: JAX reports cache events through global listeners, which cannot be unregistered one by one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.requests = 0
        self.directory: Path | None = None

    def on_event(self, event: str, **_: object) -> None:
        if event == _HIT:
            with self._lock:
                self.hits += 1
        elif event == _MISS:
            with self._lock:
                self.misses += 1

    def on_duration(self, event: str, duration_secs: float, **_: str | int) -> None:
        if event == _BACKEND_COMPILE:
            with self._lock:
                self.requests += 1


_counter = _Counter()
monitoring.register_event_listener(_counter.on_event)
monitoring.register_event_duration_secs_listener(_counter.on_duration)


def enable(directory: Path) -> None:
    """Keep compiled XLA programs under `directory` (created if missing) for every later compile of this process.

    Call it before the first compile. Several processes may share one directory (JAX writes entries atomically); on
    Kubernetes put it on a volume that outlives the pod so a rescheduled worker starts warm.
    """
    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _counter.directory = directory
    log.info("XLA persistent compilation cache at %s", directory)


def counts() -> CacheCounts:
    """Persistent-cache hits and misses of this process so far (both 0 while the cache is off), and the programs it
    built either way."""
    with _counter._lock:
        return CacheCounts(hits=_counter.hits, misses=_counter.misses, requests=_counter.requests)
