"""Compile ahead of traffic: every program a first request of each kind runs, before the JAX worker takes work.

A warm-up is a list of pieces, each small enough to run between two activities on the engine thread:

- `lifecycle`: the training half of one adapter's life on a scratch slot (the last one), at the smallest warmed
  shapes: create, forward_backward with each loss the cookbook uses (cross_entropy, importance_sampling, ppo: one
  program serves every loss, the loss is a per-row index), optim_step, then the slot freed.
- `lifecycle_sample`: the rest of it: export and import of the slot's state (checkpoints and the restore after a
  worker died), sampler snapshot, a sample through it and one of the base model, a snapshot loaded from weights
  (sampling a saved checkpoint). Both run the real programs, so the small helpers around them (slot writes,
  zeroing, the snapshot stack) are built too, with the shardings traffic uses. Nothing of them stays: the slot ends
  zeroed and unallocated, the snapshots dropped.
- `train`: the forward+backward and forward-only steps of one (rows, sequence) bucket, compiled and not run (from
  the state's shapes alone with `compile_ahead`: beside the traffic, without a turn on the engine).
- `sampler`: one sampler family (snapshots per batch, whether admissions score prompts) for every slot bucket (or
  one, `slots`: the background warm-up takes them one at a time): its empty slots, admission and decode chunk. A
  family serves every prompt length, prefix-cache hit, stop list and top-k (sampling/buckets.py).

The JAX worker runs all of them before it registers with `--warm-up ready`; with `--warm-up background` (the
default) the whole lifecycle before it registers (its sample builds the slot bucket a first sample uses) and the
rest after (WarmUpPlan.pieces gives the order): what a first user needs back to back, the rest one piece at a time
whenever the engine has been idle for a moment (`EngineLock`); everything after registering, in the same order,
when the persistent compilation cache already holds programs (a restart, a second `up`). After registering, train
and sampler pieces are compiled from shapes alone (`compile_ahead`), beside the traffic rather than in its way.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .interface import EngineApi
from .model.remat import Remat
from .runtime import persistent_cache
from .runtime.aot_cache import AotCache, abstract
from .training.steps import pack, program_label
from .types import (
    AdamConfig,
    Datum,
    ForwardBackwardInput,
    InputError,
    LoraConfig,
    PageMoves,
    SampleInput,
    WarmUpPiece,
    WarmUpPlan,
)

if TYPE_CHECKING:
    from .sampling.sampler import SlotSampler
    from .sampling.snapshots import SamplerSnapshots
    from .training.adapter_slots import AdapterSlots
    from .training.steps import StepFunctions

log = logging.getLogger(__name__)

SCRATCH_SNAPSHOT = "__warm-up__"
# The lifecycle's sample: a short prompt (any length runs the same programs: prompts are prefilled in chunks).
LIFECYCLE_PROMPT = 16


class WarmUpEngine(EngineApi, Protocol):
    """What the warm-up drives (`Engine` is one): the activities' calls and `adapter_weights`, and the parts whose
    programs it builds from their state."""

    max_lora_adapters: int

    def adapter_weights(self, slot: int) -> dict[str, np.ndarray]: ...

    @property
    def adapters(self) -> AdapterSlots: ...

    @property
    def base(self) -> Any: ...

    @property
    def steps(self) -> StepFunctions: ...

    @property
    def sampler(self) -> SlotSampler: ...

    @property
    def sampler_snapshots(self) -> SamplerSnapshots: ...


def run(engine: WarmUpEngine, pieces: tuple[WarmUpPiece, ...], threads: int = 1) -> int:
    """Run `pieces` on `engine`; the number of programs this built (compiled, or read back from the persistent
    compilation cache). With `threads` > 1 the train and forward steps of every train bucket the pieces name (the
    lifecycle's included) compile side by side on that many threads, beside the pieces' other work on this thread
    (XLA releases the GIL while it compiles; AotCache compiles each shape once, whoever asks first)."""
    t0 = time.perf_counter()
    before = persistent_cache.counts().requests
    buckets = list(dict.fromkeys((p.rows, p.seq) for p in pieces if p.kind in ("lifecycle", "train")))
    pool = concurrent.futures.ThreadPoolExecutor(threads, "warm-up") if threads > 1 and buckets else None
    futures = []
    if pool is not None:
        for rows, seq in buckets:  # the arrays' shapes taken now: this thread goes on using (and donating) them
            for step, label, args, static in _train_steps(engine, rows, seq, abstract_state=True):
                futures.append(pool.submit(step.prepare, label, *args, **static))
    try:
        for piece in pieces:
            if piece.kind == "lifecycle":
                _lifecycle(engine, piece)
            elif piece.kind == "lifecycle_sample":
                _lifecycle_sample(engine, piece)
            elif piece.kind == "train":
                if pool is None:
                    _train(engine, piece.rows, piece.seq)
            else:
                _sampler(engine, piece)
        for future in futures:
            future.result()
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    built = persistent_cache.counts().requests - before
    log.info(
        "warm-up: %d pieces, %d programs built in %.1fs (%d threads)",
        len(pieces),
        built,
        time.perf_counter() - t0,
        threads if pool is not None else 1,
    )
    return built


def compile_ahead(engine: WarmUpEngine, pieces: tuple[WarmUpPiece, ...], threads: int = 1) -> int:
    """Compile (never run) the train and forward steps of the train pieces among `pieces`, and the admissions and
    decode chunks of the sampler pieces, from the shapes of the engine's state alone: safe beside any other engine
    call (which may donate those arrays meanwhile), so it needs no turn on the engine (`EngineLock` lets it pass);
    a request that needs a program being compiled here waits for that compile alone (AotCache), never for a piece.
    The number of programs this process built meanwhile."""
    before = persistent_cache.counts().requests
    jobs = [
        job
        for p in dict.fromkeys(p for p in pieces if p.kind == "train")
        for job in _train_steps(engine, p.rows, p.seq, abstract_state=True)
    ]
    with concurrent.futures.ThreadPoolExecutor(max(1, threads), "warm-up") as pool:
        futures = [pool.submit(step.prepare, label, *args, **static) for step, label, args, static in jobs]
        futures += [pool.submit(_sampler, engine, p, from_shapes=True) for p in pieces if p.kind == "sampler"]
        for future in futures:
            future.result()
    return persistent_cache.counts().requests - before


def _train_steps(
    engine: WarmUpEngine, rows: int, seq: int, *, abstract_state: bool
) -> list[tuple[AotCache, str, tuple, dict[str, Any]]]:
    """The train and forward steps of the (rows, seq) bucket with their labels (the step's own, which name the
    checkpointing level the step will take: the same program), arguments and static settings (single-target datums,
    packed rows)."""
    steps, slots = engine.steps, engine.adapters
    batch = steps.placement.put_batch(pack([], [], steps.placement.round_rows(rows), seq, 1))
    lora, base, grads = slots.lora, engine.base, slots.grads
    remat = steps.remat(batch)
    if abstract_state:
        lora, base, grads, batch = abstract((lora, base, grads, batch))
    return [
        (steps.grad_step, f"{program_label(batch, remat)} (warm-up)", (lora, base, grads, batch), {"remat": remat}),
        (steps.forward_step, f"{program_label(batch, Remat.NONE)} (warm-up)", (lora, base, batch), {}),
    ]


def _train(engine: WarmUpEngine, rows: int, seq: int) -> None:
    """Compile (not run) the train and forward steps of the (rows, seq) bucket, single-target datums."""
    for step, label, args, static in _train_steps(engine, rows, seq, abstract_state=False):
        step.prepare(label, *args, **static)


def _sampler(engine: WarmUpEngine, piece: WarmUpPiece, *, from_shapes: bool = False) -> None:
    """One sampler piece; `from_shapes`: compiled from the state's shapes alone (SlotSampler.warm_bucket)."""
    snapshots, base = engine.sampler_snapshots, engine.base
    if from_shapes:
        lora, base = snapshots.stack_spec(piece.adapters), abstract(base)
    else:
        lora = snapshots.zero_stack(piece.adapters)
    buckets = (piece.slots,) if piece.slots else None
    engine.sampler.warm_up(lora, base, scoring=(piece.scoring,), buckets=buckets, from_shapes=from_shapes)


def first_sample_piece(plan: WarmUpPlan, slot_buckets: list[int]) -> WarmUpPiece:
    """The plan's first sampler family at the slot bucket a first sample takes (the fewest slots): what a restart
    reads back from the persistent compilation cache before it registers, so the first sample of a client that
    survived the restart pays no read-back (about a second on a 2-core CPU: its empty slots, admission and decode
    chunk), while the rest of the plan waits for the recovery (jax_worker._warm_up_later)."""
    family = next(p for p in plan.pieces() if p.kind == "sampler")
    return dataclasses.replace(family, slots=min(slot_buckets))


def split_by_slot_bucket(pieces: tuple[WarmUpPiece, ...], buckets: list[int]) -> tuple[WarmUpPiece, ...]:
    """Each whole-family sampler piece as one piece per slot bucket: a third of the time under the lock each, for a
    background warm-up that shares the engine with requests."""
    out: list[WarmUpPiece] = []
    for p in pieces:
        if p.kind == "sampler" and not p.slots:
            out += [dataclasses.replace(p, slots=b) for b in buckets]
        else:
            out.append(p)
    return tuple(out)


def _scratch_slot(engine: WarmUpEngine) -> int | None:
    slot = engine.max_lora_adapters - 1
    if slot in engine.adapters.configs:  # never touch a live adapter (the worker warms up before it takes work)
        log.warning("warm-up: slot %d is in use, adapter lifecycle not warmed", slot)
        return None
    return slot


def _lifecycle(engine: WarmUpEngine, piece: WarmUpPiece) -> None:
    """The training half of an adapter's life: create, forward_backward with each loss, optim_step. (The forward
    step is the train piece of the same bucket; export and import are in `_lifecycle_sample`: a first training user
    needs neither before its first step.)"""
    slot = _scratch_slot(engine)
    if slot is None:
        return
    n = piece.seq - 1  # a datum of seq - 1 tokens: the `seq` bucket whatever the buckets' rounding
    tokens = np.arange(n, dtype=np.int32) % engine.info.vocab_size
    zeros, ones = np.zeros(n, np.float32), np.ones(n, np.float32)
    per_loss = {
        "cross_entropy": {"target_tokens": tokens, "weights": ones},
        "importance_sampling": {"target_tokens": tokens, "logprobs": zeros, "advantages": ones},
        "ppo": {"target_tokens": tokens, "logprobs": zeros, "advantages": ones},
    }
    engine.create_adapter(slot, LoraConfig(rank=1, seed=0))
    try:
        for loss, inputs in per_loss.items():
            data = [Datum(tokens=tokens, inputs=inputs)] * piece.rows
            _expect_ok(engine.forward_backward([ForwardBackwardInput(slot=slot, data=data, loss_fn=loss)]))
        engine.optim_step(slot, AdamConfig(learning_rate=0.0))
    finally:
        engine.free_adapter(slot)


def _lifecycle_sample(engine: WarmUpEngine, piece: WarmUpPiece) -> None:
    """The rest of an adapter's life: export and import of its state (checkpoints, and the restore after a worker
    died), paging it out and back in, a sampler snapshot of it, a snapshot loaded from weights (sampling a saved
    checkpoint), a sample through it and one of the base model (the first sampler family, at every slot bucket,
    unless earlier pieces built it), then the snapshots dropped and the slot freed."""
    slot = _scratch_slot(engine)
    if slot is None:
        return
    engine.create_adapter(slot, LoraConfig(rank=1, seed=0))
    try:
        engine.import_slot(slot, engine.export_slot(slot), optimizer=True)
        # Paging (more runs than slots): the slot out to the page store and back in (training/adapter_paging.py).
        moved = engine.page(PageMoves(page_out=((slot, SCRATCH_SNAPSHOT),), page_in=((SCRATCH_SNAPSHOT, slot),)))
        if moved.failed:
            raise RuntimeError(f"warm-up paging failed: {moved.failed}")
        engine.snapshot(slot, SCRATCH_SNAPSHOT)
        engine.load_snapshot(SCRATCH_SNAPSHOT + "loaded", LoraConfig(rank=1), engine.adapter_weights(slot))
        prompt = np.arange(LIFECYCLE_PROMPT, dtype=np.int32) % engine.info.vocab_size
        for snapshot in (SCRATCH_SNAPSHOT, None):
            _expect_ok(engine.sample([SampleInput(prompt=prompt, max_tokens=4, seed=0, snapshot=snapshot)]))
    finally:
        engine.drop_snapshot(SCRATCH_SNAPSHOT)
        engine.drop_snapshot(SCRATCH_SNAPSHOT + "loaded")
        engine.free_adapter(slot)


def _expect_ok(results: list) -> None:
    for r in results:
        if isinstance(r, InputError):
            raise RuntimeError(f"warm-up request refused: {r}")
