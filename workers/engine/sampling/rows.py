"""The sampler's host-side records: one `SampleRow` per sample it is asked for, one `RowOutput` per row it answers,
and the host's helpers around them (seed words, stop strings, cutting an admission's prompt scores to one row).

A row's prompt is prefilled in chunks and may start in the prefix cache (`prefix_cache.py`): whatever is scored on
the prompt (log-probs, top-k, targets, alternative draws) comes back chunk by chunk for the positions computed, and
`PromptScores` puts them at their prompt positions.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from tinkerflow.common.images import ProcessedImage

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
    # The prompt's images in placeholder order (checked against the prompt), and as the prefix cache keys them
    # (prefix_cache.ImageSpan: placeholder range, patches' digest; `image_spans`).
    images: tuple[ProcessedImage, ...] = ()
    image_spans: tuple[tuple[int, int, bytes], ...] = ()

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


def image_spans(
    prompt: np.ndarray, images: tuple[ProcessedImage, ...], image_token_id: int
) -> tuple[tuple[int, int, bytes], ...]:
    """Each image's [start, end) placeholder range in `prompt` (image k takes the next `tokens` placeholders) and the
    sha256 of its grid and patches: two images whose placeholders are the same tokens key differently."""
    where = np.flatnonzero(prompt == image_token_id)
    spans, taken = [], 0
    for image in images:
        run = where[taken : taken + image.tokens]
        taken += image.tokens
        digest = hashlib.sha256(np.asarray(image.grid, np.int64).tobytes())
        digest.update(np.ascontiguousarray(image.patches, np.float32).tobytes())
        spans.append((int(run[0]), int(run[-1]) + 1, digest.digest()))
    return tuple(spans)


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


class PromptScores:
    """One row's prompt scores, gathered chunk by chunk from the admission's host arrays (entry t of a chunk that
    starts at prompt position `first` predicts the prompt token at first + t + 1) into prompt positions 1..P-1, with
    NaN / padding where the row took its prompt from the prefix cache (before `start + 1`)."""

    def __init__(self, row: SampleRow, start: int):
        self.row, self.start = row, start
        n = len(row.prompt) - 1
        self.out = RowOutput([], [], "length", cache_hit_tokens=start, scored_from=start + 1)
        self._lp = np.full((n,), np.nan, np.float32) if row.prompt_logprobs else None
        k = row.topk_prompt_logprobs if row.prompt_logprobs else 0
        self._top = (np.zeros((n, k), np.int32), np.full((n, k), TOPK_PAD_LOGPROB, np.float32)) if k > 0 else None
        kg = row.target_ids.shape[1] if row.target_ids is not None else 0
        self._targets = np.zeros((n, kg), np.float32) if row.target_ids is not None else None
        ka = row.prompt_alt_tokens_k
        self._alt = (np.zeros((n, ka), np.int64), np.zeros((n, ka), np.float32)) if ka > 0 else None

    def add(self, j: int, first: int, host: dict[str, np.ndarray]) -> None:
        """Row j of one chunk's host arrays, the chunk starting at prompt position `first`."""
        m = min(host[next(iter(host))].shape[1], len(self.row.prompt) - 1 - first)
        if m <= 0:
            return
        at = slice(first, first + m)
        if self._lp is not None:
            self._lp[at] = host["token_lp"][j, :m]
        if self._top is not None:
            k = self._top[0].shape[1]
            self._top[0][at], self._top[1][at] = host["top_ids"][j, :m, :k], host["top_lp"][j, :m, :k]
        if self._targets is not None:
            self._targets[at] = host["target_lp"][j, :m, : self._targets.shape[1]]
        if self._alt is not None:
            k = self._alt[0].shape[1]
            self._alt[0][at], self._alt[1][at] = host["alt_ids"][j, :m, :k], host["alt_lp"][j, :m, :k]

    def result(self) -> RowOutput:
        out = self.out
        if self._lp is not None:
            out.prompt_logprobs = self._lp.tolist()
        out.topk_prompt_logprobs = self._top
        if self._targets is not None:
            assert self.row.target_ids is not None
            out.target_logprobs = np.where(self.row.target_ids >= 0, self._targets, 0.0).astype(np.float32)
        out.prompt_alt_tokens = self._alt
        return out
