"""The engine: one base model, `max_lora_adapters` trainable LoRA slots, immutable sampler snapshots.

Called from one thread at a time (the JAX worker runs one activity at a time). Every batched call validates each
request on its own; a bad request yields an InputError in its place and never touches adapter state.

`Engine` is a facade over its parts (built and wired together in engine_parts.py), each in a module named for what
it holds: the slots' weights, gradients and
optimizer state (`training/adapter_slots.py`), training on them (`training/trainer.py`), sampler snapshots and their
LoRA stack (`sampling/snapshots.py`), and sampling requests (`sampling/sample_requests.py`, over the sampler in
`sampling/sampler.py`/`sampling/decode.py`). Its public methods are what the activities call
(`interface.EngineApi`), plus reads for export and tests, and the parts the warm-up compiles for.
"""

from __future__ import annotations

import logging

import numpy as np

from . import warm_up
from .engine_parts import DEFAULT_MICRO_BATCH_TOKENS, EngineParts
from .runtime.memory_plan import MemoryPlan
from .sampling import sample_requests
from .sampling.buckets import stack_size
from .sampling.snapshots import Snapshot
from .training import trainer
from .types import (
    AdamConfig,
    DimuonConfig,
    ForwardBackwardInput,
    ForwardBackwardResult,
    InputError,
    LoraConfig,
    PageMoves,
    PageReport,
    SampleInput,
    SampleResult,
    SlotState,
    WarmUpPiece,
    WarmUpPlan,
)

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MICRO_BATCH_TOKENS", "Engine", "MemoryPlan", "Snapshot"]


class Engine(EngineParts):
    # ------------------------------------------------------------------ adapters

    def create_adapter(self, slot: int, config: LoraConfig) -> None:
        self._adapters.create(slot, config)

    def free_adapter(self, slot: int) -> None:
        self._adapters.free(slot)

    def adapter_weights(self, slot: int) -> dict[str, np.ndarray]:
        """The slot's LoRA A [in, rank] / B [rank, out] by module path (e.g. "layers.0.mlp.up_proj.lora_a"),
        trimmed to its rank; for export and tests."""
        return self._adapters.named(self._adapters.lora, slot)

    def accumulated_grads(self, slot: int) -> dict[str, np.ndarray]:
        """Gradients accumulated for the slot since its last optim_step, named and trimmed like adapter_weights."""
        return self._adapters.named(self._adapters.grads, slot)

    def set_adapter_weights(self, slot: int, weights: dict[str, np.ndarray]) -> None:
        """Overwrite an allocated slot's LoRA weights (names and rank-trimmed shapes as in adapter_weights)."""
        self._adapters.set_weights(slot, weights)

    def export_slot(self, slot: int) -> SlotState:
        """The slot's config, weights, optimizer moments and step, named and trimmed like adapter_weights."""
        return self._adapters.export(slot)

    def import_slot(self, slot: int, state: SlotState, *, optimizer: bool) -> LoraConfig:
        """(Re)configure `slot` (allocated or not) as `state`: its weights, and its optimizer moments and step when
        `optimizer` (else zero moments, step 0); the gradient accumulator is zeroed. Missing tensors are zero. An
        allocated slot keeps its optimizer family (with `optimizer`, the state's must be the same). Every check runs
        before anything is written. Returns the slot's config as it now is."""
        return self._adapters.import_(slot, state, optimizer=optimizer)

    # ------------------------------------------------------------------ paging (more runs than slots)

    def page(self, moves: PageMoves) -> PageReport:
        """Move adapters between training slots and the page store (training/adapter_paging.py); a move that fails
        leaves that adapter lost on this worker (its slot free), named in the report, and the others go on."""
        return self._pager.move(moves)

    # ------------------------------------------------------------------ snapshots

    def snapshot(self, slot: int, key: str) -> None:
        """An immutable sampler snapshot of the slot's weights as they are now."""
        self._sampler_snapshots.take(slot, key)

    def load_snapshot(self, key: str, config: LoraConfig, weights: dict[str, np.ndarray]) -> None:
        """A sampler snapshot from named weights (as adapter_weights; missing ones are zero), no slot involved."""
        self._sampler_snapshots.load(key, config, weights)

    def snapshot_evicted(self, key: str) -> bool:
        """True when `key` was a snapshot here and the byte budget pushed it out (saved weights reload on demand)."""
        return self._sampler_snapshots.evicted(key)

    def drop_snapshot(self, key: str) -> None:
        self._sampler_snapshots.drop(key)

    # ------------------------------------------------------------------ training

    def forward_backward(self, requests: list[ForwardBackwardInput]) -> list[ForwardBackwardResult | InputError]:
        budget = max(16, min(self.micro_batch_tokens, self.memory.max_train_tokens))
        return trainer.forward_backward(
            self._adapters,
            self._steps,
            self._base,
            requests,
            info=self.info,
            micro_batch_tokens=budget,
            memory=self.memory,
            room=self._room,
        )

    def _room(self, needed: int) -> int:
        """Bytes free for a program that needs `needed`, after letting go of the sampler's idle KV caches if that is
        what it takes."""
        free = self.memory.free_bytes()
        if needed > free and self._sampler.release_idle():
            free = self.memory.free_bytes()
        return free

    def optim_step(self, slot: int, config: AdamConfig | DimuonConfig) -> dict[str, float]:
        return trainer.optim_step(self._adapters, slot, config)

    # ------------------------------------------------------------------ sampling

    @property
    def sample_slots(self) -> int:
        """Decode slots (rows decoded together) at most; smaller row buckets are powers of 8 below it."""
        return self._sampler.max_slots

    @sample_slots.setter
    def sample_slots(self, value: int) -> None:
        self._sampler.max_slots = self._layout.round_rows(int(value))

    @property
    def slot_buckets(self) -> list[int]:
        """The sampler's decode-slot buckets (rows decoded together), smallest first."""
        return [b.slots for b in self._sampler.buckets()]

    def prefer_buckets(self, plan: WarmUpPlan) -> None:
        """Round training sequences up to the buckets `plan` warms, where one fits, so a workload within them
        compiles nothing (from now on, whether or not the warm-up ran yet). The sampler's shapes are fixed already
        (sampling/buckets.py)."""
        pieces = plan.pieces()
        self._steps.warmed_seqs = frozenset(p.seq for p in pieces if p.kind == "train")
        self._steps.warmed_rows = frozenset(p.rows for p in pieces if p.kind == "train")

    def schedule_warm_up(self, pieces: tuple[WarmUpPiece, ...]) -> None:
        """The sampler families among `pieces` are about to be warmed up in the background: a request that comes
        first compiles only its own slot bucket of them (sampler.py)."""
        self._sampler.scheduled_families = frozenset(
            (stack_size(p.adapters), p.scoring) for p in pieces if p.kind == "sampler"
        )

    def warm_up(self, pieces: tuple[WarmUpPiece, ...], threads: int = 1) -> int:
        """Compile ahead of traffic what `pieces` name (see warm_up.py; `WarmUpPlan.pieces()` lists them), leaving
        no state behind; returns the number of programs built (compiled, or read back from the persistent cache).
        `threads` > 1: the train buckets' steps compile side by side on that many threads."""
        return warm_up.run(self, tuple(pieces), threads)

    def compile_ahead(self, pieces: tuple[WarmUpPiece, ...], threads: int = 1) -> int:
        """Compile, never run, the train buckets and sampler families among `pieces` (COMPILE_ONLY_KINDS), from the
        state's shapes alone: safe beside any other call of this engine, from another thread
        (warm_up.compile_ahead). Programs built."""
        return warm_up.compile_ahead(self, tuple(pieces), threads)

    def sample(self, requests: list[SampleInput]) -> list[SampleResult | InputError]:
        with self._sampler_snapshots.paged_in(r.snapshot for r in requests if r.snapshot is not None):
            return sample_requests.sample(
                self._sampler, self._sampler_snapshots, self._base, requests, info=self.info, memory=self.memory
            )
