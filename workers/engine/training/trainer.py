"""Training on the adapter slots: batched forward_backward (gradients accumulate per slot) and a per-slot optimizer
step (AdamW or Dimuon).

The jitted programs are in `steps.py` (the micro-batched grad step), `optimizer.py` (AdamW on one slot's slice) and
`dimuon.py` (Dimuon on one slot's slice); this module turns the engine's requests into them. Each request of a batch
is validated on its own: a bad one yields an InputError in its place and never touches any slot's state, and an
optimizer step whose result would not be finite is refused before anything is written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..runtime.memory_plan import FLAGS, MemoryPlan
from ..types import AdamConfig, DimuonConfig, ForwardBackwardInput, ForwardBackwardResult, InputError, ModelInfo
from . import custom_loss_jax
from .adapter_slots import AdapterSlots
from .datum_checks import forward_backward_rows
from .dimuon import dimuon_slot_values, pack_dimuon
from .optimizer import adamw_slot_values, pack_hparams, write_slot_values
from .steps import DoesNotFit, Row, StepFunctions, run_rows

log = logging.getLogger(__name__)


def forward_backward(
    slots: AdapterSlots,
    steps: StepFunctions,
    base: Any,
    requests: list[ForwardBackwardInput],
    *,
    info: ModelInfo,
    micro_batch_tokens: int,
    memory: MemoryPlan | None = None,
    room: Callable[[int], int] | None = None,
) -> list[ForwardBackwardResult | InputError]:
    """One pass over every valid request's rows (slots mixed in one batch); gradients add into `slots.grads`.

    With `memory`, a datum longer than the plan admits is refused before anything else; with `room`, a request
    whose micro-batch's compiled program needs more memory than is free is refused before any program runs, and
    the others go on without it."""
    if any(req.loss_fn == "custom" for req in requests):
        return _with_custom_losses(
            slots, steps, base, requests, info=info, micro_batch_tokens=micro_batch_tokens, memory=memory, room=room
        )
    results: list[ForwardBackwardResult | InputError | None] = [None] * len(requests)
    rows: list[Row] = []
    spans: dict[int, tuple[int, int]] = {}
    for r, req in enumerate(requests):
        try:
            slots.check_slot(req.slot)
            new = forward_backward_rows(
                req,
                slot_scale=slots.scale(req.slot),
                vocab=info.vocab_size,
                max_len=info.max_position_embeddings,
                image_token_id=info.image_token_id,
            )
            for i, row in enumerate(new):
                if memory is not None and len(row.tokens) > memory.max_train_tokens:
                    raise InputError(memory.train_limit_message(f"datum {i}: model_input", len(row.tokens)))
        except InputError as e:
            results[r] = e
            continue
        spans[r] = (len(rows), len(rows) + len(new))
        rows.extend(new)
    while rows:
        t0 = time.perf_counter()
        try:
            slots.grads, outputs = run_rows(steps, slots.lora, base, slots.grads, rows, micro_batch_tokens, room)
        except DoesNotFit as e:  # nothing ran: refuse the requests in that micro-batch, run the rest
            rows, spans = _without(e, rows, spans, requests, results)
            continue
        log.debug("forward_backward: %d rows in %.3fs", len(rows), time.perf_counter() - t0)
        for r, (lo, hi) in spans.items():
            per_datum = []
            total = 0.0
            for i in range(lo, hi):
                o = outputs[i]
                shape_1d = requests[r].data[i - lo].inputs["target_tokens"]
                lp = o.target_logprobs if np.ndim(shape_1d) == 2 else o.target_logprobs[:, 0]
                per_datum.append(
                    {"logprobs": lp.astype(np.float32), "elementwise_loss": o.token_loss.astype(np.float32)}
                )
                total += float(np.sum(o.token_loss, dtype=np.float64))
            results[r] = ForwardBackwardResult(outputs=per_datum, metrics={"loss:sum": total})
        break
    return results  # type: ignore[return-value]


def _without(e: DoesNotFit, rows: list[Row], spans: dict[int, tuple[int, int]], requests: list, results: list):
    """The rows and spans left once the requests owning the rows of `e` are answered with a user error."""
    failing = {r for r, (lo, hi) in spans.items() if any(lo <= i < hi for i in e.rows)}
    for r in failing:
        results[r] = InputError(
            f"forward_backward needs {e.needed / 2**30:.2f} GiB of device memory for a micro-batch of {e.tokens:,} "
            f"tokens and {e.free / 2**30:.2f} GiB are free: send fewer or shorter datums per call, or give the "
            f"worker more memory ({FLAGS})"
        )
    kept_rows: list[Row] = []
    kept: dict[int, tuple[int, int]] = {}
    for r, (lo, hi) in spans.items():
        if r not in failing:
            kept[r] = (len(kept_rows), len(kept_rows) + hi - lo)
            kept_rows.extend(rows[lo:hi])
    return kept_rows, kept


def _with_custom_losses(
    slots: AdapterSlots, steps: StepFunctions, base: Any, requests: list[ForwardBackwardInput], **options: Any
) -> list[ForwardBackwardResult | InputError]:
    """Requests with a server-side custom loss (custom_loss_jax.py): a forward pass for their logprobs, the loss and
    its gradient per datum, then one pass of every request, theirs as cross_entropy with weights -dLoss/dlogprobs."""
    results: list[ForwardBackwardResult | InputError | None] = [None] * len(requests)
    prepared: dict[int, custom_loss_jax.Prepared] = {}
    for r, req in enumerate(requests):
        if req.loss_fn == "custom":
            try:
                slots.check_slot(req.slot)
                prepared[r] = custom_loss_jax.prepare(req)
            except InputError as e:
                results[r] = e
    probes = forward_backward(slots, steps, base, [p.probe for p in prepared.values()], **options)
    final: dict[int, ForwardBackwardInput] = {r: req for r, req in enumerate(requests) if req.loss_fn != "custom"}
    done: dict[int, tuple[float, dict[str, float], ForwardBackwardResult]] = {}
    for (r, prep), probe in zip(prepared.items(), probes, strict=True):
        try:
            if isinstance(probe, InputError):
                raise probe
            total, metrics, train = custom_loss_jax.weighted(prep, requests[r], [o["logprobs"] for o in probe.outputs])
        except InputError as e:
            results[r] = e
            continue
        done[r] = (total, metrics, probe)
        if not requests[r].forward_only:
            final[r] = train
    order = sorted(final)
    for r, out in zip(order, forward_backward(slots, steps, base, [final[r] for r in order], **options), strict=True):
        results[r] = out
    for r, (total, metrics, probe) in done.items():
        out = results[r] if r in final else probe  # forward-only: the probe's logprobs are the answer
        if isinstance(out, ForwardBackwardResult):  # the loss's value and metrics, not the cross_entropy surrogate's
            out = ForwardBackwardResult(
                [{"logprobs": o["logprobs"]} for o in out.outputs], {**metrics, "loss:sum": total}
            )
        results[r] = out
    return results  # type: ignore[return-value]


def optim_step(slots: AdapterSlots, slot: int, config: AdamConfig | DimuonConfig) -> dict[str, float]:
    """The slot's optimizer step (AdamW or Dimuon, as the slot was created) with its accumulated gradients, which it
    then clears; returns grad_norm, learning_rate, step."""
    slots.check_slot(slot)
    cfg = slots.configs[slot]
    params_of = {"adamw": "AdamParams", "dimuon": "DimuonParams"}
    given = "dimuon" if isinstance(config, DimuonConfig) else "adamw"
    if cfg.optimizer != given:
        raise InputError(
            f"this training run was created with optimizer {cfg.optimizer!r}, which stays fixed for its lifetime: "
            f"optim_step needs {params_of[cfg.optimizer]}, got {params_of[given]}"
        )
    shape = (cfg.train_attn, cfg.train_mlp, cfg.train_unembed)
    if isinstance(config, DimuonConfig):
        values = (
            config.learning_rate,
            config.beta1,
            config.grad_clip_norm,
            config.damping,
            config.rank_lr_correction_exponent,
        )
        problem = _dimuon_problem(config)
        if problem:
            raise InputError(problem)
        new, count, metrics = dimuon_slot_values(
            slots.lora, slots.grads, slots.opt, np.int32(slot), pack_dimuon(values, cfg.rank, shape)
        )
        return _write_step(slots, slot, new, count, metrics, config.learning_rate)
    adam = config
    values = (adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay, adam.grad_clip_norm)
    if not all(np.isfinite(v) for v in values) or adam.learning_rate < 0 or adam.eps < 0:
        raise InputError(f"invalid AdamConfig {adam}")
    if not (0 <= adam.beta1 < 1 and 0 <= adam.beta2 < 1):
        raise InputError(f"AdamConfig betas must be in [0, 1), got beta1={adam.beta1} beta2={adam.beta2}")
    packed = pack_hparams(values, cfg.rank, shape)
    # Only the slot's slice is read and written (in place, the state is donated); the outputs keep the
    # placement's shardings, and the two metrics come back in one small transfer.
    new, count, metrics = adamw_slot_values(slots.lora, slots.grads, slots.opt, np.int32(slot), packed)
    return _write_step(slots, slot, new, count, metrics, adam.learning_rate)


def _dimuon_problem(config: DimuonConfig) -> str:
    for name, value in vars(config).items():
        if not np.isfinite(value):
            return f"DimuonConfig.{name} must be finite, got {value}"
    if config.learning_rate < 0:
        return f"DimuonConfig.learning_rate must be >= 0, got {config.learning_rate}"
    if not config.damping > 0:
        return f"DimuonConfig.damping must be > 0, got {config.damping}"
    if not 0 <= config.beta1 < 1:
        return f"DimuonConfig.beta1 must be in [0, 1), got {config.beta1}"
    return ""


def _write_step(slots: AdapterSlots, slot: int, new: Any, count: Any, metrics: Any, lr: float) -> dict[str, float]:
    """Write a step's values (from adamw_slot_values or dimuon_slot_values) unless they are not finite."""
    grad_norm, step, finite = np.asarray(slots.placement.to_host(metrics), np.float64).tolist()
    if not finite:
        # Refused before the weights or moments are written, so the run never holds NaN for good and keeps
        # working (a lower learning_rate, or a load_state). The step consumed its gradients as a good step does:
        # NaN ones kept in the accumulator would poison every later step.
        slots.grads = slots.zero_slot(slots.grads, np.int32(slot))
        why = (
            f"the accumulated gradients are not finite (grad_norm={grad_norm}): the forward_backward calls "
            "since the last step produced NaN or infinity, typically because earlier steps made the weights "
            "too large"
            if not np.isfinite(grad_norm)
            else f"learning_rate={lr} (grad_norm={grad_norm}) would make the weights not finite"
        )
        raise InputError(
            f"optim_step not applied: {why}; the weights and optimizer moments are unchanged and the "
            "accumulated gradients were dropped. Lower the learning_rate, or load_state an earlier "
            "checkpoint"
        )
    # Only the slot's slice is written (in place, the state is donated); the outputs keep the placement's
    # shardings.
    slots.lora, slots.grads, slots.opt = write_slot_values(
        slots.lora, slots.grads, slots.opt, np.int32(slot), new, count, placement=slots.placement
    )
    return {"grad_norm": grad_norm, "learning_rate": float(lr), "step": step}
