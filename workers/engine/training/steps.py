"""The fused forward(+backward) step and the host-side packing of datums into bucketed micro-batches.

Rows are right-padded to a sequence bucket and batches to a power-of-two row bucket; padded positions and rows have
mask/weights 0 and `train` 0, so they contribute exactly zero loss and gradient. Micro-batches are cut by a token
budget; gradients are sums, so accumulating micro-batches equals the full batch.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..model.config import round_up_pow2, round_up_seq_len
from ..model.lora import LoraRouting
from ..runtime.aot_cache import AotCache, warmed_bucket
from ..runtime.sharding import DeviceLayout
from .losses import LossInputs, token_losses


@jax.tree_util.register_dataclass
@dataclass
class TrainBatch:
    tokens: jax.Array  # int32 [B, T]
    targets: jax.Array  # int32 [B, T, K]
    routing: LoraRouting
    loss: LossInputs
    train: jax.Array  # float32 [B]: 1 where this row's gradient is accumulated (not forward_only, not padding)


@dataclass
class Row:
    """One datum, validated and converted: everything the step needs, unpadded."""

    tokens: np.ndarray  # int32 [N]
    targets: np.ndarray  # int32 [N, K]
    weights: np.ndarray  # float32 [N, K]
    sampler_logprobs: np.ndarray  # float32 [N]
    advantages: np.ndarray  # float32 [N]
    seq_mask: np.ndarray  # float32 [N]: gspo's sequence_ratio_mask / stable_reinforce's sampled positions
    loss_id: int
    clip_low: float
    clip_high: float
    beta: float
    slot: int
    scale: float
    train: bool


@dataclass
class RowOutput:
    target_logprobs: np.ndarray  # float32 [N, K]
    token_loss: np.ndarray  # float32 [N]


def pack(rows: list[Row], batch: int, seq: int, k: int) -> TrainBatch:
    """Pad rows into one [batch, seq] bucket as numpy (device transfer happens at the jit call)."""
    tokens = np.zeros((batch, seq), np.int32)
    targets = np.zeros((batch, seq, k), np.int32)
    weights = np.zeros((batch, seq, k), np.float32)
    mask = np.zeros((batch, seq), np.float32)
    old_lp = np.zeros((batch, seq), np.float32)
    adv = np.zeros((batch, seq), np.float32)
    seq_mask = np.zeros((batch, seq), np.float32)
    per_row = np.zeros((6, batch), np.float32)  # clip_low, clip_high, beta, scale, train, loss_id
    slots = np.zeros((batch,), np.int32)
    for i, r in enumerate(rows):
        n, kk = r.targets.shape
        tokens[i, :n] = r.tokens
        targets[i, :n, :kk] = r.targets
        weights[i, :n, :kk] = r.weights
        mask[i, :n] = 1.0
        old_lp[i, :n] = r.sampler_logprobs
        adv[i, :n] = r.advantages
        seq_mask[i, :n] = r.seq_mask
        per_row[:, i] = (r.clip_low, r.clip_high, r.beta, r.scale, float(r.train), r.loss_id)
        slots[i] = r.slot
    # numpy leaves (host side, see the docstring): the jit call moves them; the fields name the traced type.
    return TrainBatch(
        tokens=tokens,  # pyright: ignore[reportArgumentType]
        targets=targets,  # pyright: ignore[reportArgumentType]
        routing=LoraRouting(adapter=slots, scale=per_row[3]),  # pyright: ignore[reportArgumentType]
        loss=LossInputs(
            loss_id=per_row[5].astype(np.int32),
            weights=weights,  # pyright: ignore[reportArgumentType]
            mask=mask,  # pyright: ignore[reportArgumentType]
            sampler_logprobs=old_lp,  # pyright: ignore[reportArgumentType]
            advantages=adv,  # pyright: ignore[reportArgumentType]
            clip_low=per_row[0],
            clip_high=per_row[1],
            beta=per_row[2],
            seq_mask=seq_mask,  # pyright: ignore[reportArgumentType]
        ),
        train=per_row[4],
    )


def plan_micro_batches(
    rows: list[Row], token_budget: int, warmed_seqs: Collection[int] = ()
) -> list[tuple[list[int], int, int]]:
    """Group row indices (longest first) into (indices, batch bucket, seq bucket) under `token_budget` tokens each.
    A sequence bucket is the smallest of `warmed_seqs` that fits, when one does (no compile mid-workload)."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].tokens))
    plans = []
    start = 0
    while start < len(order):
        seq = warmed_bucket(round_up_seq_len(len(rows[order[start]].tokens)), warmed_seqs)
        cap = max(1, token_budget // seq)
        cap = 1 << (cap.bit_length() - 1)  # largest power of two within budget, so full chunks are exact buckets
        chunk = order[start : start + cap]
        plans.append((chunk, round_up_pow2(len(chunk)), seq))
        start += cap
    return plans


def _forward(graphdef: nnx.GraphDef, lora: Any, base: Any, batch: TrainBatch):
    model = nnx.merge(graphdef, lora, base)
    b, t = batch.tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    logits = model(batch.tokens, positions, batch.routing)
    logp = jax.nn.log_softmax(logits, axis=-1)
    target_lp = jnp.take_along_axis(logp, batch.targets, axis=-1)  # [B, T, K]
    per_token = token_losses(target_lp, batch.loss)
    total = jnp.sum(per_token * batch.train[:, None])
    return total, (target_lp, per_token)


class StepFunctions:
    """The forward and forward+backward steps, compiled ahead of time once per (batch, seq, k) bucket.

    Inputs arrive placed (parameters by their shardings, the batch on fsdp); outputs are pinned to the same
    layouts, so the donated accumulator keeps its sharding from call to call.
    """

    def __init__(self, graphdef: nnx.GraphDef, placement: DeviceLayout):
        self.placement = placement
        # Sequence buckets the warm-up compiles (Engine.prefer_buckets); batches round up to them. Fixed at start,
        # whatever the warm-up got to, so a batch's shapes (and so its float rounding) never depend on timing.
        self.warmed_seqs: frozenset[int] = frozenset()

        def grad_step(lora, base, acc, batch):
            grad_fn = jax.value_and_grad(lambda lo: _forward(graphdef, lo, base, batch), has_aux=True)
            (_, (target_lp, per_token)), grads = grad_fn(lora)
            acc = placement.constrain_params(jax.tree.map(jnp.add, acc, grads))
            return acc, *placement.constrain_batch((target_lp, per_token))

        def forward_step(lora, base, batch):
            _, (target_lp, per_token) = _forward(graphdef, lora, base, batch)
            return placement.constrain_batch((target_lp, per_token))

        self.grad_step = AotCache("train step", grad_step, donate=("acc",))
        self.forward_step = AotCache("forward step", forward_step)

    def grad(self, lora, base, acc, batch: TrainBatch):
        return self.grad_step(_label(batch), lora, base, acc, batch)

    def forward(self, lora, base, batch: TrainBatch):
        return self.forward_step(_label(batch), lora, base, batch)


def _label(batch: TrainBatch) -> str:
    b, t, k = batch.targets.shape
    return f"batch={b} seq={t}" + (f" k={k}" if k > 1 else "")


def run_rows(
    steps: StepFunctions, lora: Any, base: Any, acc: Any, rows: list[Row], token_budget: int
) -> tuple[Any, list[RowOutput]]:
    """Run every row through forward (+backward where row.train), accumulating into `acc`; outputs in row order."""
    outputs: list[RowOutput | None] = [None] * len(rows)
    k = max(r.targets.shape[1] for r in rows)
    for idx, batch_rows, seq in plan_micro_batches(rows, token_budget, steps.warmed_seqs):
        batch = pack([rows[i] for i in idx], steps.placement.round_rows(batch_rows), seq, k)
        batch = steps.placement.put_batch(batch)
        if any(rows[i].train for i in idx):
            acc, target_lp, per_token = steps.grad(lora, base, acc, batch)
        else:
            target_lp, per_token = steps.forward(lora, base, batch)
        target_lp, per_token = steps.placement.to_host((target_lp, per_token))  # also split across hosts
        for j, i in enumerate(idx):
            n, kk = rows[i].targets.shape
            outputs[i] = RowOutput(target_logprobs=target_lp[j, :n, :kk], token_loss=per_token[j, :n])
    return acc, outputs  # type: ignore[return-value]
