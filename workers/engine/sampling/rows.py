"""The sampler's host-side records: one `SampleRow` per sample it is asked for, one `RowOutput` per row it answers,
and the host's helpers around them (seed words, stop strings, cutting an admission's prompt scores to one row).

A row's prompt may start in the prefix cache (`prefix_cache.py`): the admission then computes only its suffix, and
whatever is scored on the prompt (log-probs, top-k, targets, alternative draws) comes back for the suffix's positions
only; `prompt_scores` puts those rows back at their prompt positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from ..types import TOPK_PAD_LOGPROB


@dataclass
class SampleRow:
    """One sample of one request, as the host queues it."""

    prompt: np.ndarray  # int32 [P]
    max_tokens: int  # already clamped to the context
    temperature: float
    top_k: int
    top_p: float
    seed: tuple[int, int]
    sample_index: int
    stop_ids: list[int]
    adapter: int  # index into the LoRA stack; -1 = base model
    scale: float
    prompt_logprobs: bool = False
    stop_strings: list[str] = field(default_factory=list)
    topk_prompt_logprobs: int = 0  # > 0 (with prompt_logprobs): also keep this many top tokens per prompt position
    topk_sample_logprobs: int = 0  # > 0: the k most likely tokens at every sampled position
    # int32 [P - 1, K]: ids whose log-probs to score at prompt positions 1..P-1 (-1: none); None: not asked
    target_ids: np.ndarray | None = None
    prompt_alt_tokens_k: int = 0  # > 0: draws per prompt position 1..P-1 at the row's temperature
    # The prefix cache: the namespace a row's prompt blocks are shared in (None: not cached), and the first prompt
    # position whose hidden state the row needs (everything before it may come from the cache).
    cache_namespace: tuple | None = None
    needs_from: int = 0

    @property
    def scores_prompt(self) -> bool:
        return self.prompt_logprobs or self.target_ids is not None or self.prompt_alt_tokens_k > 0


@dataclass
class RowOutput:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: Literal["stop", "length"]
    prompt_logprobs: list[float] | None = None  # [P - 1], for rows that asked
    # (token ids int32 [P - 1, k], log-probs float32 [P - 1, k]), for rows that asked for k > 0
    topk_prompt_logprobs: tuple[np.ndarray, np.ndarray] | None = None
    topk_sample_logprobs: tuple[np.ndarray, np.ndarray] | None = None  # [len(tokens), k] ids, log-probs
    target_logprobs: np.ndarray | None = None  # float32 [P - 1, K], 0.0 where the row's target id was -1
    prompt_alt_tokens: tuple[np.ndarray, np.ndarray] | None = None  # [P - 1, k] ids int64, log-probs float32
    cache_hit_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache
    # Positions 1..P-1 scored (None: none): a row that starts in the prefix cache scores only from there on.
    scored_from: int = 1


def seed_words(seed: int) -> tuple[int, int]:
    seed &= (1 << 64) - 1
    return seed & 0xFFFFFFFF, seed >> 32


def first_stop_string_end(tokenizer: Any, tokens: list[int], stops: list[str], checked: int) -> int | None:
    """Smallest k > checked such that the decoded tokens[:k] contain a stop string, else None."""
    if not any(s in tokenizer.decode(tokens) for s in stops):
        return None
    for k in range(max(checked, 0) + 1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:k])
        if any(s in text for s in stops):
            return k
    return len(tokens)


def prompt_scores(row: SampleRow, j: int, start: int, host: dict[str, np.ndarray]) -> RowOutput:
    """Row j's prompt scores from an admission's host arrays (suffix coordinates: entry t predicts the prompt token
    at start + t + 1), placed at prompt positions 1..P-1 with NaN / padding before `start + 1`."""
    n = len(row.prompt) - 1
    m = n - start  # positions the admission scored for this row
    out = RowOutput([], [], "length", cache_hit_tokens=start, scored_from=start + 1)
    if row.prompt_logprobs:
        lp = np.full((n,), np.nan, np.float32)
        lp[start:] = host["token_lp"][j, :m]
        out.prompt_logprobs = lp.tolist()
        k = row.topk_prompt_logprobs
        if k > 0:
            ids, lps = np.zeros((n, k), np.int32), np.full((n, k), TOPK_PAD_LOGPROB, np.float32)
            ids[start:], lps[start:] = host["top_ids"][j, :m, :k], host["top_lp"][j, :m, :k]
            out.topk_prompt_logprobs = (ids, lps)
    if row.target_ids is not None:
        kg = row.target_ids.shape[1]
        tl = np.zeros((n, kg), np.float32)
        tl[start:] = host["target_lp"][j, :m, :kg]
        out.target_logprobs = np.where(row.target_ids >= 0, tl, 0.0).astype(np.float32)
    if row.prompt_alt_tokens_k > 0:
        k = row.prompt_alt_tokens_k
        out.prompt_alt_tokens = (host["alt_ids"][j, :m, :k].astype(np.int64), host["alt_lp"][j, :m, :k].copy())
    return out
