"""The engine's lock: engine calls one at a time, so a background warm-up and the activities take turns.

The JAX worker serves its engine (an `Engine`, or the multi-host `DrivenEngine` around one) through an `EngineLock`.
Every engine call holds the lock: an activity's call waits at most for the one warm-up piece in progress, and waits
inside its activity, which heartbeats meanwhile; `compile_ahead` alone passes without it (it reads only shapes, and
compiles). The lock also tells how long the engine has been idle (`idle_seconds`: the background warm-up starts a
piece only after a pause in the traffic, so a burst of requests, such as a recovery's restore and replay, is not
slowed by it) and how many calls it served (`calls`); a warm-up is not traffic.

The activities' calls (`interface.EngineApi`) come through `EngineForwarder`, so the worker hands an `EngineLock` to the
activities as it is; the reads the worker makes (the model's facts, the sampler's buckets) pass through without the
lock.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .interface import EngineForwarder
from .model.families import ModelConfig
from .types import WarmUpPiece

__all__ = ["EngineLock"]


class EngineLock(EngineForwarder):
    """`engine` with every call under one lock (see the module doc)."""

    __slots__ = ("_busy", "_engine", "_last_end", "calls", "lock")

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.lock = threading.Lock()
        self._busy = 0
        self._last_end = time.monotonic()
        self.calls = 0  # engine calls served (warm-ups not counted)

    @property
    def engine(self) -> Any:
        """The engine inside, for what must not wait for the lock (a multi-host worker telling its followers to stop,
        tests looking inside)."""
        return self._engine

    def idle_seconds(self) -> float:
        """Seconds since the last engine call other than a warm-up ended; 0 while one runs or waits."""
        return 0.0 if self._busy else time.monotonic() - self._last_end

    def _inner(self) -> Any:
        return self._engine

    def _forward(self, name: str, args: tuple, kwargs: dict) -> Any:
        """An activity's call (interface.EngineApi), under the lock."""
        self._busy += 1  # under the GIL; read only as a hint
        try:
            with self.lock:
                return getattr(self._engine, name)(*args, **kwargs)
        finally:
            self._last_end = time.monotonic()
            self._busy -= 1
            self.calls += 1

    # Reads, without the lock (`info` too: EngineForwarder).
    @property
    def model_path(self) -> str:
        return self._engine.model_path

    @property
    def config(self) -> ModelConfig:
        return self._engine.config

    @property
    def sample_slots(self) -> int:
        return self._engine.sample_slots

    @property
    def slot_buckets(self) -> list[int]:
        return self._engine.slot_buckets

    @property
    def adapter_page_bytes(self) -> int:
        return self._engine.adapter_page_bytes

    @property
    def page_capacity(self) -> int:
        return self._engine.page_capacity

    # The warm-up: a piece that runs programs takes the lock (and is not traffic); compiling only does not.
    def warm_up(self, pieces: tuple[WarmUpPiece, ...], threads: int = 1) -> int:
        with self.lock:
            return self._engine.warm_up(pieces, threads)

    def compile_ahead(self, pieces: tuple[WarmUpPiece, ...], threads: int = 1) -> int:
        return self._engine.compile_ahead(pieces, threads)
