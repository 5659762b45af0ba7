"""The checks of a sample request: a bad request becomes an InputError naming the field and value, before any of
it reaches a device."""

from __future__ import annotations

import math

import numpy as np

from ..training.datum_checks import int_array
from ..types import InputError, SampleInput
from .decode import MAX_TARGET_PROMPT_LOGPROBS, MAX_TOPK_PROMPT_LOGPROBS, MAX_TOPK_SAMPLE_LOGPROBS


def check_sample(req: SampleInput, *, vocab: int, max_len: int, snapshots: set[str]) -> np.ndarray:
    """Validate one sample request; returns the prompt as int32 [P]."""
    prompt = int_array(req.prompt, "prompt", vocab).reshape(-1)
    if len(prompt) == 0:
        raise InputError("prompt is empty")
    if len(prompt) >= max_len:
        raise InputError(f"prompt has {len(prompt)} tokens; max_position_embeddings={max_len} leaves no room to sample")
    if req.num_samples < 1:
        raise InputError(f"num_samples must be >= 1, got {req.num_samples}")
    if req.max_tokens < 1:
        raise InputError(f"max_tokens must be >= 1, got {req.max_tokens}")
    if not (math.isfinite(req.temperature) and req.temperature >= 0):
        raise InputError(f"temperature must be a finite number >= 0, got {req.temperature}")
    if not (0 < req.top_p <= 1):
        raise InputError(f"top_p must be in (0, 1], got {req.top_p}")
    if req.top_k == 0 or req.top_k < -1:
        raise InputError(f"top_k must be -1 (off) or >= 1, got {req.top_k}")
    if req.stop_token_ids is not None:
        int_array(np.asarray(req.stop_token_ids, dtype=np.int64), "stop_token_ids", vocab)
    if any(not isinstance(s, str) or not s for s in req.stop_strings):
        raise InputError(f"stop_strings must be non-empty strings, got {req.stop_strings!r}")
    if not 0 <= req.topk_prompt_logprobs <= MAX_TOPK_PROMPT_LOGPROBS:
        raise InputError(
            f"topk_prompt_logprobs must be in [0, {MAX_TOPK_PROMPT_LOGPROBS}], got {req.topk_prompt_logprobs}"
        )
    if req.snapshot is not None and req.snapshot not in snapshots:
        raise InputError(f"unknown sampler snapshot {req.snapshot!r}")
    _check_sample_extras(req, len(prompt), vocab)
    return prompt


def _check_sample_extras(req: SampleInput, p: int, vocab: int) -> None:
    """The SampleRequest fields beyond sampling itself (docs/wire-contract.md §Sampling)."""
    if not 0 <= req.topk_sample_logprobs <= MAX_TOPK_SAMPLE_LOGPROBS:
        raise InputError(
            f"topk_sample_logprobs must be in [0, {MAX_TOPK_SAMPLE_LOGPROBS}], got {req.topk_sample_logprobs}"
        )
    if not 0 <= req.prompt_alt_tokens_k <= MAX_TOPK_PROMPT_LOGPROBS:
        raise InputError(
            f"prompt_alt_tokens_k must be in [0, {MAX_TOPK_PROMPT_LOGPROBS}], got {req.prompt_alt_tokens_k}"
        )
    n = req.prompt_logprobs_last_n
    if n is not None:
        if not (req.include_prompt_logprobs or req.topk_prompt_logprobs):
            raise InputError("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs")
        if not 1 <= n <= p - 1:
            raise InputError(f"prompt_logprobs_last_n must be in [1, len(prompt) - 1 = {p - 1}], got {n}")
    t = req.target_prompt_logprobs
    if t is not None:
        ids = np.asarray(t)
        if ids.ndim != 2 or ids.shape[0] != p - 1:
            raise InputError(
                f"target_prompt_logprobs must have shape [len(prompt) - 1, K] = [{p - 1}, K], got {list(ids.shape)}"
            )
        if not 1 <= ids.shape[1] <= MAX_TARGET_PROMPT_LOGPROBS:
            raise InputError(
                f"target_prompt_logprobs has {ids.shape[1]} columns; 1 to {MAX_TARGET_PROMPT_LOGPROBS} are allowed"
            )
        if ids.dtype.kind not in "iu" or (ids.size and (ids.min() < -1 or ids.max() >= vocab)):
            bad = ids[(ids < -1) | (ids >= vocab)] if ids.dtype.kind in "iu" else ids.ravel()
            raise InputError(
                f"target_prompt_logprobs holds token id {bad.flat[0]} outside [0, {vocab}) (or -1 for none)"
            )
        if not (ids >= 0).any():
            raise InputError("target_prompt_logprobs names no token id (every cell is -1)")
