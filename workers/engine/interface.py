"""The engine as the activities see it: the methods `run_batch` and the checkpoint I/O call, and nothing else.

`Engine` (engine.py) runs the calls. Two wrappers pass them on, both through `EngineForwarder` below, the one place the
calls are spelled out again: the multi-host `DrivenEngine` (multihost.py), which first has the other processes
of its group replay each call, and `EngineLock` (engine_lock.py), through which the JAX worker serves either,
one call at a time; each says only what forwarding means to it (`_forward`). Activities type their engine as
`EngineApi`, so any fits; a method added here is added to `Engine` and `EngineForwarder` (tests/engine/test_interface.py
compares the signatures). Everything else the worker or tests reach for (warm-up, named weights, the sampler's slot
count) is outside this contract on purpose: the activities must not depend on it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from .types import (
    AdamConfig,
    DimuonConfig,
    ForwardBackwardInput,
    ForwardBackwardResult,
    InputError,
    LoraConfig,
    ModelInfo,
    PageMoves,
    PageReport,
    SampleInput,
    SampleResult,
    SlotState,
)

__all__ = ["EngineApi", "EngineForwarder"]


@runtime_checkable
class EngineApi(Protocol):
    """One base model with LoRA slots and sampler snapshots. Calls come from one thread at a time; a bad request
    raises (or, in a batch, yields in its place) an InputError and changes no state."""

    @property
    def info(self) -> ModelInfo:
        """The base model's facts (vocab size, context length, eos ids) the activities check requests against."""
        ...

    # adapter slots
    def create_adapter(self, slot: int, config: LoraConfig) -> None: ...

    def free_adapter(self, slot: int) -> None: ...

    def export_slot(self, slot: int) -> SlotState: ...

    def import_slot(self, slot: int, state: SlotState, *, optimizer: bool) -> LoraConfig: ...

    # paging adapters between slots and the page store (more runs than slots)
    def page(self, moves: PageMoves) -> PageReport: ...

    # training
    def forward_backward(self, requests: list[ForwardBackwardInput]) -> list[ForwardBackwardResult | InputError]: ...

    def optim_step(self, slot: int, config: AdamConfig | DimuonConfig) -> dict[str, float]: ...

    # sampler snapshots
    def snapshot(self, slot: int, key: str) -> None: ...

    def load_snapshot(self, key: str, config: LoraConfig, weights: dict[str, np.ndarray]) -> None: ...

    def snapshot_evicted(self, key: str) -> bool: ...

    def drop_snapshot(self, key: str) -> None: ...

    # sampling
    def sample(self, requests: list[SampleInput]) -> list[SampleResult | InputError]: ...


class EngineForwarder:
    """EngineApi passed on to a wrapped engine: every call goes to `_forward(name, args, kwargs)` and `info` is read
    from `_inner()`, which a wrapper defines."""

    __slots__ = ()

    def _inner(self) -> Any:
        raise NotImplementedError

    def _forward(self, name: str, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    @property
    def info(self) -> ModelInfo:
        return self._inner().info

    def create_adapter(self, slot: int, config: LoraConfig) -> None:
        return self._forward("create_adapter", (slot, config), {})

    def free_adapter(self, slot: int) -> None:
        return self._forward("free_adapter", (slot,), {})

    def export_slot(self, slot: int) -> SlotState:
        return self._forward("export_slot", (slot,), {})

    def import_slot(self, slot: int, state: SlotState, *, optimizer: bool) -> LoraConfig:
        return self._forward("import_slot", (slot, state), {"optimizer": optimizer})

    def page(self, moves: PageMoves) -> PageReport:
        return self._forward("page", (moves,), {})

    def forward_backward(self, requests: list[ForwardBackwardInput]) -> list[ForwardBackwardResult | InputError]:
        return self._forward("forward_backward", (requests,), {})

    def optim_step(self, slot: int, config: AdamConfig | DimuonConfig) -> dict[str, float]:
        return self._forward("optim_step", (slot, config), {})

    def snapshot(self, slot: int, key: str) -> None:
        return self._forward("snapshot", (slot, key), {})

    def load_snapshot(self, key: str, config: LoraConfig, weights: dict[str, np.ndarray]) -> None:
        return self._forward("load_snapshot", (key, config, weights), {})

    def snapshot_evicted(self, key: str) -> bool:
        return self._forward("snapshot_evicted", (key,), {})

    def drop_snapshot(self, key: str) -> None:
        return self._forward("drop_snapshot", (key,), {})

    def sample(self, requests: list[SampleInput]) -> list[SampleResult | InputError]:
        return self._forward("sample", (requests,), {})
