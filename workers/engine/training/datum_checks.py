"""The checks of a forward_backward's datums: a bad datum becomes an InputError naming the field and value, and
nothing it carries ever reaches a device (one tenant's out-of-range token cannot NaN-poison another's batch). The
token-id and number checks here serve the sampler's requests too (sampling/sample_checks.py)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tinkerflow.common.images import MAX_IMAGES_PER_DATUM, ProcessedImage

from ..types import Datum, ForwardBackwardInput, InputError
from .losses import (
    LOSS_CONFIG_DEFAULTS,
    LOSS_ID,
    LOSS_NAMES,
    LOSS_OPTIONAL_INPUTS,
    LOSS_REQUIRED_INPUTS,
    LOSSES_NEEDING_PROVENANCE,
)
from .steps import Row


def int_array(value: Any, what: str, vocab: int) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and arr.size and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            arr = arr.astype(np.int64)
        elif arr.size:
            raise InputError(f"{what} must be integer token ids, got dtype {arr.dtype}")
        else:
            arr = arr.astype(np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        bad = int(arr[(arr < 0) | (arr >= vocab)].flat[0])
        raise InputError(f"{what} contains token id {bad} outside [0, {vocab})")
    return arr.astype(np.int32)


def float_array(value: Any, what: str) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float64)
    if not np.all(np.isfinite(arr)):
        raise InputError(f"{what} contains non-finite values")
    return arr.astype(np.float32)


def loss_config(loss_fn: str, config: dict[str, Any]) -> dict[str, float]:
    if loss_fn not in LOSS_ID:
        raise InputError(f"unknown loss_fn {loss_fn!r}; supported: {', '.join(LOSS_NAMES)}")
    defaults = LOSS_CONFIG_DEFAULTS[loss_fn]
    unknown = sorted(set(config or {}) - set(defaults))
    if unknown:
        allowed = ", ".join(defaults) or "none"
        raise InputError(f"{loss_fn} does not take loss_fn_config {unknown}; accepted keys: {allowed}")
    out = dict(defaults)
    for key, value in (config or {}).items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            raise InputError(f"loss_fn_config[{key!r}] must be a number, got {value!r}") from None
        if not math.isfinite(out[key]):
            raise InputError(f"loss_fn_config[{key!r}] must be finite, got {value!r}")
    return out


def datum_row(
    i: int, d: Datum, loss_fn: str, cfg: dict[str, float], *, vocab: int, max_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tokens [N], targets [N, K], weights [N, K], sampler logprobs [N], advantages [N], seq_mask [N]) or
    InputError."""
    tokens = int_array(d.tokens, f"datum {i}: model_input", vocab).reshape(-1)
    n = len(tokens)
    if n == 0:
        raise InputError(f"datum {i}: model_input is empty")
    if n > max_len:
        raise InputError(f"datum {i}: model_input has {n} tokens, more than max_position_embeddings={max_len}")
    inputs = d.inputs or {}
    for name in LOSS_REQUIRED_INPUTS[loss_fn]:
        if name not in inputs:
            raise InputError(f"datum {i}: {loss_fn} needs loss_fn_inputs[{name!r}]")

    def check_len(name: str, arr: np.ndarray) -> None:
        if arr.ndim == 0 or arr.shape[0] != n:
            got = "a scalar" if arr.ndim == 0 else f"{arr.shape[0]} entries"
            raise InputError(f"datum {i}: {name} has {got} but model_input has {n} tokens")

    targets = int_array(inputs["target_tokens"], f"datum {i}: target_tokens", vocab)
    check_len("target_tokens", targets)
    if targets.ndim == 2 and loss_fn != "cross_entropy":
        raise InputError(f"datum {i}: {loss_fn} needs target_tokens of shape [N], got {list(targets.shape)}")
    if targets.ndim not in (1, 2) or (targets.ndim == 2 and targets.shape[1] == 0):
        raise InputError(f"datum {i}: target_tokens must be [N] or [N, K], got shape {list(targets.shape)}")
    targets2 = targets.reshape(n, -1)

    if "weights" in inputs and "weights" in LOSS_OPTIONAL_INPUTS.get(loss_fn, ()):
        weights = float_array(inputs["weights"], f"datum {i}: weights")
        if weights.shape != targets.shape:
            raise InputError(
                f"datum {i}: weights has shape {list(weights.shape)} but target_tokens has {list(targets.shape)}"
            )
        weights = weights.reshape(n, -1)
    else:
        weights = np.ones(targets2.shape, np.float32)

    vectors = {}
    for name in ("logprobs", "advantages"):
        if name in LOSS_REQUIRED_INPUTS[loss_fn]:
            arr = float_array(inputs[name], f"datum {i}: {name}")
            check_len(name, arr)
            if arr.ndim != 1:
                raise InputError(f"datum {i}: {name} must have shape [N], got {list(arr.shape)}")
            vectors[name] = arr
        else:
            vectors[name] = np.zeros((n,), np.float32)
    seq_mask = _seq_mask(i, d, loss_fn, n, vectors["advantages"], check_len)
    return tokens, targets2, weights, vectors["logprobs"], vectors["advantages"], seq_mask


def _seq_mask(i: int, d: Datum, loss_fn: str, n: int, adv: np.ndarray, check_len) -> np.ndarray:
    """gspo: the tokens in the sequence ratio; stable_reinforce: the sampled tokens (from provenance); else zeros."""
    inputs = d.inputs or {}
    if loss_fn == "gspo":
        if "sequence_ratio_mask" in inputs:
            mask = float_array(inputs["sequence_ratio_mask"], f"datum {i}: sequence_ratio_mask")
            check_len("sequence_ratio_mask", mask)
            if mask.ndim != 1:
                raise InputError(f"datum {i}: sequence_ratio_mask must have shape [N], got {list(mask.shape)}")
            return (mask != 0).astype(np.float32)
        # rl.train sends no sequence_ratio_mask: its sampled tokens are exactly those with an advantage.
        return (adv != 0).astype(np.float32)
    if loss_fn in LOSSES_NEEDING_PROVENANCE:
        if d.sampled_mask is None:
            raise InputError(
                f"datum {i}: {loss_fn} needs provenance (Datum.with_provenance) naming the sampled sequence behind "
                "its target tokens; this datum has none"
            )
        mask = np.asarray(d.sampled_mask, np.float32).reshape(-1)
        check_len("loss_fn_input_spans", mask)
        if not mask.any():
            raise InputError(f"datum {i}: {loss_fn} needs at least one SampledProvenanceSpan in loss_fn_input_spans")
        outside = np.flatnonzero((mask == 0) & (adv != 0))
        if outside.size:
            raise InputError(
                f"datum {i}: advantages must be 0 outside the sampled tokens for {loss_fn}; position "
                f"{int(outside[0])} has advantage {float(adv[outside[0]])} but no SampledProvenanceSpan covers it"
            )
        return mask
    return np.zeros((n,), np.float32)


def datum_images(i: int, d: Datum, tokens: np.ndarray, image_token_id: int | None) -> tuple[ProcessedImage, ...]:
    """The datum's images, checked against its placeholder tokens (`checked_images`). InputError naming the datum."""
    return checked_images(f"datum {i}", tuple(d.images), tokens, image_token_id)


def checked_images(
    where: str, images: tuple[ProcessedImage, ...], tokens: np.ndarray, image_token_id: int | None
) -> tuple[ProcessedImage, ...]:
    """`images` checked against the placeholder tokens of `tokens`: each image's `tokens` consecutive
    `image_token_id` tokens, in order, and no placeholder without its image. InputError naming `where`."""
    if image_token_id is None:
        if images:
            raise InputError(f"{where}: this base model has no vision tower: it takes text chunks only, not images")
        return images
    if len(images) > MAX_IMAGES_PER_DATUM:
        raise InputError(f"{where}: {len(images)} images, over the limit of {MAX_IMAGES_PER_DATUM} per datum")
    for j, image in enumerate(images):
        if image.patches.ndim != 2 or len(image.patches) != math.prod(image.grid):
            raise InputError(f"{where}: image {j} has patches {list(image.patches.shape)} for grid {image.grid}")
    is_image = tokens == image_token_id
    counts = [image.tokens for image in images]
    if int(is_image.sum()) != sum(counts):
        raise InputError(
            f"{where}: model_input has {int(is_image.sum())} image placeholder tokens (id {image_token_id}) but "
            f"its {len(images)} images become {sum(counts)}: send images as ImageChunks, not their placeholder token"
        )
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]])))
    runs = np.cumsum(edges[1::2] - edges[::2]).tolist()
    if not set(runs) <= set(np.cumsum(counts).tolist()):
        raise InputError(f"{where}: an image's placeholder tokens (id {image_token_id}) are not one consecutive run")
    return images


def forward_backward_rows(
    req: ForwardBackwardInput, *, slot_scale: float, vocab: int, max_len: int, image_token_id: int | None = None
) -> list[Row]:
    """The request's datums as Rows; `image_token_id` None: the model takes no images."""
    cfg = loss_config(req.loss_fn, req.loss_fn_config)
    if not req.data:
        raise InputError("forward_backward needs at least one datum")
    rows = []
    for i, d in enumerate(req.data):
        tokens, targets, weights, old_lp, adv, seq_mask = datum_row(
            i, d, req.loss_fn, cfg, vocab=vocab, max_len=max_len
        )
        if req.loss_fn != "cross_entropy":
            weights = np.zeros_like(weights)  # only cross_entropy reads weights; keep its branch inert
        rows.append(
            Row(
                tokens=tokens,
                targets=targets,
                weights=weights,
                sampler_logprobs=old_lp,
                advantages=adv,
                seq_mask=seq_mask,
                loss_id=LOSS_ID[req.loss_fn],
                clip_low=cfg.get("clip_low_threshold", 0.0),
                clip_high=cfg.get("clip_high_threshold", 0.0),
                beta=cfg.get("beta", cfg.get("kl_coeff", 0.0)),
                slot=req.slot,
                scale=slot_scale,
                train=not req.forward_only,
                images=datum_images(i, d, tokens, image_token_id),
            )
        )
    return rows
