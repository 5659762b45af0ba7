"""The fused forward(+backward) step and the host-side packing of datums into bucketed micro-batches.

Packing: the datums of a call (of one adapter slot; each row carries one slot's LoRA routing) are packed first-fit
decreasing into rows of one bucketed length, each datum a *segment* of its row (attention stays within a segment,
positions restart at each segment's start), so 64 datums of 50 tokens cost about 3,200 tokens of work, not 64 padded
rows. The row length is the bucket of the longest datum, or of the largest slot's total when that is longer, up to
`PACK_TOKENS`. Every per-token input travels per token (loss id, clip thresholds, beta, whether the token trains), so
datums of different requests and losses share a row; a datum's numbers do not depend on what it is packed with.
Padding tokens have segment 0, mask 0 and train 0: they contribute exactly zero loss and gradient. Micro-batches are
cut by a token budget; gradients are sums, so accumulating micro-batches equals the full batch.

Images (a vision-language model's datums): a datum's images stay in its own segment, as its tokens do, so datums
with and without images pack together. A micro-batch with images carries them as the family's image batch
(`StepFunctions.image_batch`: the patches padded to a bucket, the tower's per-patch inputs, the 3-D positions), and
its program is compiled per patch bucket besides (rows, length); a text-only micro-batch's program is unchanged.

Long rows: gradient checkpointing is chosen per micro-batch by its token count (its length bucket; set from the
device-memory plan, model/remat.py): none below `remat_min_tokens`, DOTS (the matmul outputs kept, the elementwise
work recomputed) below `full_remat_min_tokens`, FULL (whole layers recomputed) from there; and the loss reads the
vocabulary in chunks (logprobs.py), so activation memory grows linearly in length and never holds [tokens, vocab]
logits.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tinkerflow.common.images import ProcessedImage

from ..model.attention import Segments, single_segment_matters
from ..model.logprobs import chunk_tokens, target_logprobs
from ..model.lora import LoraRouting
from ..model.remat import Remat
from ..model.sharding import DeviceLayout
from ..runtime.aot_cache import AotCache
from ..shape_buckets import round_up_pow4, train_seq_len
from .losses import LossInputs, token_losses

# Rows are packed up to this many tokens (or the longest datum's bucket, when longer).
PACK_TOKENS = 4096


@jax.tree_util.register_dataclass
@dataclass
class TrainBatch:
    tokens: jax.Array  # int32 [B, T]
    positions: jax.Array  # int32 [B, T]: restart at 0 at each segment's start
    segments: Segments  # int32 [B, T]: 1, 2, ... per datum in the row, 0 = padding
    targets: jax.Array  # int32 [B, T, K]
    routing: LoraRouting  # per row: every datum of a row is of one slot
    loss: LossInputs
    train: jax.Array  # float32 [B, T]: 1 where the token's gradient is accumulated (not forward_only, not padding)
    images: Any = None  # the family's image batch (None: no datum of the micro-batch has an image)


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
    images: tuple[ProcessedImage, ...] = ()  # in the order of their placeholder runs in `tokens`


@dataclass
class RowOutput:
    target_logprobs: np.ndarray  # float32 [N, K]
    token_loss: np.ndarray  # float32 [N]


@dataclass
class MicroBatch:
    """Packed rows of datum indices (each inner list one row, its datums in order), the row bucket and length."""

    packed: list[list[int]]
    rows: int
    seq: int
    single: bool = field(default=False)  # every row holds one datum (a fused single-segment kernel may apply)


ImageBatcher = Callable[[np.ndarray, np.ndarray, list[ProcessedImage]], Any]


def pack(
    rows: list[Row],
    packed: list[list[int]],
    batch: int,
    seq: int,
    k: int,
    *,
    single: bool = False,
    image_batch: ImageBatcher | None = None,
) -> TrainBatch:
    """Lay out `packed` (datum indices per row) as one [batch, seq] bucket in numpy (the jit call moves it);
    `image_batch` lays out the images of its datums (tokens, segments, images in placeholder order)."""
    tokens = np.zeros((batch, seq), np.int32)
    positions = np.zeros((batch, seq), np.int32)
    segments = np.zeros((batch, seq), np.int32)
    targets = np.zeros((batch, seq, k), np.int32)
    weights = np.zeros((batch, seq, k), np.float32)
    per_token = np.zeros((8, batch, seq), np.float32)  # mask, old lp, adv, seq_mask, clip lo/hi, beta, train
    loss_id = np.zeros((batch, seq), np.int32)
    slots = np.zeros((batch,), np.int32)
    scales = np.zeros((batch,), np.float32)
    for b, members in enumerate(packed):
        at = 0
        for seg, i in enumerate(members, start=1):
            r = rows[i]
            n, kk = r.targets.shape
            cut = slice(at, at + n)
            tokens[b, cut] = r.tokens
            positions[b, cut] = np.arange(n)
            segments[b, cut] = seg
            targets[b, cut, :kk] = r.targets
            weights[b, cut, :kk] = r.weights
            per_token[:, b, cut] = np.stack(
                [
                    np.ones(n, np.float32),
                    r.sampler_logprobs,
                    r.advantages,
                    r.seq_mask,
                    np.full(n, r.clip_low),
                    np.full(n, r.clip_high),
                    np.full(n, r.beta),
                    np.full(n, float(r.train)),
                ]
            )
            loss_id[b, cut] = r.loss_id
            at += n
        if members:
            slots[b], scales[b] = rows[members[0]].slot, rows[members[0]].scale
    mask, old_lp, adv, seq_mask, lo, hi, beta, train = per_token
    images = [image for members in packed for i in members for image in rows[i].images]  # row-major, as placed
    if images and image_batch is None:
        raise ValueError("a datum has images but this model takes none")
    image_inputs = image_batch(tokens, segments, images) if images and image_batch is not None else None
    # numpy leaves (host side, see the docstring): the jit call moves them; the fields name the traced type.
    return TrainBatch(
        tokens=tokens,  # pyright: ignore[reportArgumentType]
        positions=positions,  # pyright: ignore[reportArgumentType]
        segments=Segments(segments, single=single),  # pyright: ignore[reportArgumentType]
        targets=targets,  # pyright: ignore[reportArgumentType]
        routing=LoraRouting(adapter=slots, scale=scales),  # pyright: ignore[reportArgumentType]
        loss=LossInputs(
            loss_id=loss_id,  # pyright: ignore[reportArgumentType]
            weights=weights,  # pyright: ignore[reportArgumentType]
            mask=mask,  # pyright: ignore[reportArgumentType]
            sampler_logprobs=old_lp,  # pyright: ignore[reportArgumentType]
            advantages=adv,  # pyright: ignore[reportArgumentType]
            clip_low=lo,  # pyright: ignore[reportArgumentType]
            clip_high=hi,  # pyright: ignore[reportArgumentType]
            beta=beta,  # pyright: ignore[reportArgumentType]
            seq_mask=seq_mask,  # pyright: ignore[reportArgumentType]
            segments=segments,  # pyright: ignore[reportArgumentType]
        ),
        train=train,  # pyright: ignore[reportArgumentType]
        images=image_inputs,
    )


def _first_fit(lengths: dict[int, int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: datum indices into bins of `capacity` tokens (a datum longer than it gets its own)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(lengths, key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        spot = next((b for b, free in enumerate(room) if free >= n), None)
        if spot is None:
            bins.append([i])
            room.append(capacity - n)
        else:
            bins[spot].append(i)
            room[spot] -= n
    return bins


def plan_micro_batches(
    rows: list[Row],
    token_budget: int,
    warmed_seqs: Collection[int] = (),
    pack_tokens: int = PACK_TOKENS,
    warmed_rows: Collection[int] = (),
    max_seq: int | None = None,
) -> list[MicroBatch]:
    """Pack each slot's datums into rows and cut the rows into micro-batches of at most `token_budget` tokens (rows a
    power of four up to what the budget holds, one length per micro-batch: shape_buckets.py train_seq_len),
    longest rows first. A slot's row length is the bucket of its longest datum, or of its total when that is longer, up
    to `pack_tokens` (0: no packing, one datum per row). Where the longest datum fits a warmed bucket (`warmed_seqs`,
    `warmed_rows`: what the warm-up compiled), rows take warmed shapes: the smallest warmed length that holds the packed
    rows, else the longest warmed one with more rows, so a workload within the warm-up compiles nothing."""
    by_slot: dict[tuple[int, float], dict[int, int]] = {}
    for i, r in enumerate(rows):
        by_slot.setdefault((r.slot, r.scale), {})[i] = len(r.tokens)
    by_seq: dict[int, list[list[int]]] = {}
    for group in by_slot.values():
        longest = train_seq_len(max(group.values()), max_seq)
        seq = max(longest, min(train_seq_len(sum(group.values()), max_seq), max(pack_tokens, longest)))
        fitting = [w for w in warmed_seqs if w >= longest]
        if fitting:
            seq = min((w for w in fitting if w >= seq), default=max(fitting))
        if pack_tokens <= 0:  # one datum per row (the unpacked layout, for comparisons)
            seq = min(fitting, default=longest)
            by_seq.setdefault(seq, []).extend([i] for i in sorted(group, key=lambda i: -group[i]))
            continue
        by_seq.setdefault(seq, []).extend(_first_fit(group, seq))
    plans = []
    for seq in sorted(by_seq, reverse=True):
        bins = by_seq[seq]
        cap = max(1, token_budget // seq)
        cap = 1 << (cap.bit_length() - 1)  # largest power of two within budget, so full chunks are exact buckets
        single = single_segment_matters() and all(len(b) == 1 for b in bins)
        for start in range(0, len(bins), cap):
            chunk = bins[start : start + cap]
            n = round_up_pow4(len(chunk), cap)
            n = min((w for w in warmed_rows if n <= w <= cap), default=n)
            plans.append(MicroBatch(chunk, n, seq, single))
    return plans


def _forward(graphdef: nnx.GraphDef, lora: Any, base: Any, batch: TrainBatch, remat: Remat):
    model = nnx.merge(graphdef, lora, base)
    b = batch.tokens.shape[0]
    images = {} if batch.images is None else {"images": batch.images}  # only a vision-language model takes them
    h, _ = model.hidden(batch.tokens, batch.positions, batch.routing, segments=batch.segments, remat=remat, **images)
    chunk = chunk_tokens(b, model.config.vocab_size)
    target_lp = target_logprobs(model, h, batch.targets, batch.routing, chunk)  # [B, T, K]
    per_token = token_losses(target_lp, batch.loss)
    total = jnp.sum(per_token * batch.train)
    return total, (target_lp, per_token)


class StepFunctions:
    """The forward and forward+backward steps, compiled ahead of time once per (batch, seq, k, remat level) bucket.

    Inputs arrive placed (parameters by their shardings, the batch on fsdp); outputs are pinned to the same
    layouts, so the donated accumulator keeps its sharding from call to call.
    """

    def __init__(self, graphdef: nnx.GraphDef, placement: DeviceLayout, *, gradient_checkpointing: bool = False):
        self.placement = placement
        # Sequence buckets the warm-up compiles (Engine.prefer_buckets); batches round up to them. Fixed at start,
        # whatever the warm-up got to, so a batch's shapes (and so its float rounding) never depend on timing.
        self.warmed_seqs: frozenset[int] = frozenset()
        self.warmed_rows: frozenset[int] = frozenset()
        self.pack_tokens = PACK_TOKENS  # rows are packed up to this many tokens (see plan_micro_batches)
        # The most tokens one row may have (the memory plan's; None: no limit): a row length bucket past it is not
        # taken where a tighter one holds the row (shape_buckets.py train_seq_len).
        self.max_seq: int | None = None
        # Micro-batches of at least `remat_min_tokens` tokens recompute each layer's elementwise work in the backward
        # pass (Remat.DOTS), of at least `full_remat_min_tokens` the whole layer (Remat.FULL), instead of keeping
        # its activations (the device-memory plan sets both; 0 with --gradient-checkpointing: always FULL).
        self.remat_min_tokens = 0 if gradient_checkpointing else DEFAULT_REMAT_MIN_TOKENS
        self.full_remat_min_tokens = 0 if gradient_checkpointing else DEFAULT_REMAT_MIN_TOKENS
        # A level every train step takes whatever its length (None: by length, as above): benchmarks compare levels.
        self.forced_remat: Remat | None = None
        # The family's image layout for this model (Family.image_batch with its config); None: it takes no images.
        self.image_batch: ImageBatcher | None = None

        def grad_step(lora, base, acc, batch, *, remat: Remat):
            grad_fn = jax.value_and_grad(lambda lo: _forward(graphdef, lo, base, batch, remat), has_aux=True)
            (_, (target_lp, per_token)), grads = grad_fn(lora)
            acc = placement.constrain_params(jax.tree.map(jnp.add, acc, grads))
            return acc, *placement.constrain_batch((target_lp, per_token))

        def forward_step(lora, base, batch):
            _, (target_lp, per_token) = _forward(graphdef, lora, base, batch, Remat.NONE)
            return placement.constrain_batch((target_lp, per_token))

        self.grad_step = AotCache("train step", grad_step, donate=("acc",))
        self.forward_step = AotCache("forward step", forward_step)

    def remat(self, batch: TrainBatch) -> Remat:
        """The level of `batch`'s train step: the least recomputation whose memory the plan gives its tokens."""
        if self.forced_remat is not None:
            return self.forced_remat
        tokens = batch.tokens.size
        if tokens >= self.full_remat_min_tokens:
            return Remat.FULL
        return Remat.DOTS if tokens >= self.remat_min_tokens else Remat.NONE

    def grad(self, lora, base, acc, batch: TrainBatch):
        remat = self.remat(batch)
        return self.grad_step(program_label(batch, remat), lora, base, acc, batch, remat=remat)

    def forward(self, lora, base, batch: TrainBatch):
        return self.forward_step(program_label(batch, Remat.NONE), lora, base, batch)

    def needed_bytes(self, lora, base, acc, batch: TrainBatch, *, train: bool) -> int:
        """Device memory the step for `batch` allocates beyond its inputs (compiling it now if it was not yet)."""
        if train:
            remat = self.remat(batch)
            return self.grad_step.needed_bytes(program_label(batch, remat), lora, base, acc, batch, remat=remat)
        return self.forward_step.needed_bytes(program_label(batch, Remat.NONE), lora, base, batch)


# Without a device-memory plan: recompute whole layers (FULL) for micro-batches of at least this many tokens.
DEFAULT_REMAT_MIN_TOKENS = 8192


def program_label(batch: TrainBatch, remat: Remat) -> str:
    """The program's name in logs and compile records: its shapes and, when it checkpoints, the level
    (`remat=dots` / `remat=full`)."""
    b, t, k = batch.targets.shape
    patches = f" patches={batch.images.patches.shape[0]}" if batch.images is not None else ""
    return (
        f"batch={b} seq={t}"
        + (f" k={k}" if k > 1 else "")
        + patches
        + ("" if remat is Remat.NONE else f" remat={remat.value}")
    )


class DoesNotFit(Exception):
    """A micro-batch whose program needs more device memory than is free: raised before anything runs, naming the
    rows in it (so their requests can be refused and the others run)."""

    def __init__(self, rows: list[int], needed: int, free: int, tokens: int):
        super().__init__(f"{needed} bytes needed, {free} free")
        self.rows, self.needed, self.free, self.tokens = rows, needed, free, tokens


def run_rows(
    steps: StepFunctions,
    lora: Any,
    base: Any,
    acc: Any,
    rows: list[Row],
    token_budget: int,
    room: Callable[[int], int] | None = None,
) -> tuple[Any, list[RowOutput]]:
    """Run every row through forward (+backward where row.train), accumulating into `acc`; outputs in row order.

    With `room` (bytes needed -> bytes free, after making what room it can), every micro-batch's program is compiled
    and its memory checked against it first: one that cannot fit raises DoesNotFit before any program runs, so
    nothing is half-applied."""
    outputs: list[RowOutput | None] = [None] * len(rows)
    k = round_up_pow4(max(r.targets.shape[1] for r in rows))  # target widths 1, 4, 16, ...: a few programs
    work = []
    for plan in plan_micro_batches(
        rows, token_budget, steps.warmed_seqs, steps.pack_tokens, steps.warmed_rows, steps.max_seq
    ):
        batch = pack(
            rows,
            plan.packed,
            steps.placement.round_rows(plan.rows),
            plan.seq,
            k,
            single=plan.single,
            image_batch=steps.image_batch,
        )
        batch = steps.placement.put_batch(batch)
        train = any(rows[i].train for members in plan.packed for i in members)
        if room is not None:
            needed = steps.needed_bytes(lora, base, acc, batch, train=train)
            free = room(needed)
            if needed > free:
                members = [i for m in plan.packed for i in m]
                raise DoesNotFit(members, needed, free, sum(len(rows[i].tokens) for i in members))
        work.append((plan, batch, train))
    for plan, batch, train in work:
        if train:
            acc, target_lp, per_token = steps.grad(lora, base, acc, batch)
        else:
            target_lp, per_token = steps.forward(lora, base, batch)
        target_lp, per_token = steps.placement.to_host((target_lp, per_token))  # also split across hosts
        for b, members in enumerate(plan.packed):
            at = 0
            for i in members:
                n, kk = rows[i].targets.shape
                outputs[i] = RowOutput(
                    target_logprobs=target_lp[b, at : at + n, :kk], token_loss=per_token[b, at : at + n]
                )
                at += n
    return acc, outputs  # type: ignore[return-value]
