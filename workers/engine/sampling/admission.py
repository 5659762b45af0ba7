"""One admission, host side: which queued rows go in together, where their prompts start in the prefix cache, and
the arrays of each prompt chunk `decode.admit` prefills for them (their sampling settings among them: `row_params`).

Rows are taken from the front of the queue; a row whose prompt starts like one already taken (same cache namespace,
same first block) waits for the next admission, where it finds that row's blocks in the cache: the samples of one
request (a GRPO group) prefill their prompt once, and the others only what follows the cached blocks. A row's
prompt starts in the cache up to the block before the first position whose hidden state it needs
(`SampleRow.needs_from`: its last token to sample from, earlier ones when it scores the prompt).

An admission's rows are prefilled in chunks of one length (the sampler's chunk for the cache length): chunk k of a
row covers its prompt positions start + k·C .. start + (k+1)·C - 1, so every prompt length and every cache hit runs
the same program. The admission is done once its longest remaining prompt is; a row whose prompt ended earlier is a
padding row of the later chunks.

On a model with recurrent layers a row that starts in the cache first takes the snapshot of its layers' states at
its start (`resume`), and a row that snapshots the block boundary before its last token (prefix_cache.py) pauses
there: its chunk that reaches the boundary ends at it (its state there is the slot's after that chunk, copied to
the pool: `snap`), and one more chunk prefills the rest, at most a block. The chunks keep their one length.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .buckets import STOP_IDS
from .decode import MAX_TARGET_PROMPT_LOGPROBS
from .prefix_cache import BLOCK, PrefixIndex
from .rows import SampleRow
from .token_choice import RowParams


@dataclass(frozen=True)
class Chunk:
    """The arrays of one `decode.admit` call (names as its arguments), and which admitted rows it finishes."""

    chunk: np.ndarray  # int32 [R, C]
    nexts: np.ndarray  # int32 [R, C]
    start: np.ndarray  # int32 [R]
    prompt_len: np.ndarray  # int32 [R]
    index: np.ndarray  # int32 [R]
    final: np.ndarray  # bool [R]
    cached: np.ndarray  # int32 [R]
    read: np.ndarray  # int32 [R, NB]
    write: np.ndarray  # int32 [R, C / BLOCK]
    targets: np.ndarray  # int32 [R, C, K]
    resume: np.ndarray  # int32 [R]: the state slot a row resumes from before this chunk (NO_STATE: none)
    snap: np.ndarray  # int32 [R]: the state slot a row's state after this chunk goes to (NO_STATE: none)


# No state slot: an index past any pool, which reads as nothing and writes nowhere.
NO_STATE = np.iinfo(np.int32).max


@dataclass
class Admission:
    """Rows admitted together into their slots, and where each one's prompt starts in the prefix cache."""

    chosen: list[int]  # rows, in the order of the arrays
    slots: list[int]  # the slot each takes
    starts: list[int]  # prompt tokens each takes from the cache
    read: list[list[int]]  # the pool blocks of those tokens
    writes: list[list[int]]  # per prompt block from the row's first computed one on: the pool block (-1: none)
    resumes: list[int]  # the state slot each resumes from (-1: none)
    pauses: list[int]  # where each pauses its prefill to snapshot its state (0: nowhere)
    snaps: list[int]  # the state slot of that snapshot
    # Some row asks for: prompt logprobs, target logprobs, prompt draws. Any of them makes a scoring admission (its
    # program computes each of them only when some row asks: data, not a shape).
    wants: tuple[bool, bool, bool]

    @property
    def scoring(self) -> bool:
        return any(self.wants)

    def chunk_count(self, rows: list[SampleRow], c: int) -> int:
        return max(len(self.pieces(j, len(rows[i].prompt), c)) for j, i in enumerate(self.chosen))

    def pieces(self, j: int, p: int, c: int) -> list[tuple[int, int]]:
        """(first, end) prompt positions of row j's chunks: `c` at a time from its start, one ending at its pause."""
        s, pause = self.starts[j], self.pauses[j]
        out = [(f, min(f + c, pause or p)) for f in range(s, pause or p, c)]
        return out + [(pause, p)] if pause else out

    def chunks(
        self, rows: list[SampleRow], r: int, c: int, cache_len: int, slots: int, pool_blocks: int
    ) -> Iterator[Chunk]:
        """The admission's chunks in order, each padded to `r` rows of `c` tokens (module docstring)."""
        for k in range(self.chunk_count(rows, c)):
            yield self.chunk(rows, k, r, c, cache_len, slots, pool_blocks)

    def chunk(
        self, rows: list[SampleRow], k: int, r: int, c: int, cache_len: int, slots: int, pool_blocks: int
    ) -> Chunk:
        nb, per = cache_len // BLOCK, c // BLOCK
        out = blank(r, c, cache_len, slots, pool_blocks, self.scoring)
        for j, (i, slot, s) in enumerate(zip(self.chosen, self.slots, self.starts)):
            row = rows[i]
            p = len(row.prompt)
            pieces = self.pieces(j, p, c)
            if k >= len(pieces):
                continue  # its prompt is done: a padding row of this chunk
            first, end = pieces[k]
            piece = row.prompt[first:end]
            out.chunk[j, : len(piece)] = piece
            after = row.prompt[first + 1 : end + 1]
            out.nexts[j, : len(after)] = after
            # A chunk ending at a pause is a non-final one whose prompt ends there: its state is the boundary's.
            out.start[j], out.prompt_len[j], out.index[j] = first, end, slot
            out.final[j] = end >= p
            if k == 0 and s:
                out.cached[j] = s
                out.read[j, : len(self.read[j])] = self.read[j]
                if self.resumes[j] >= 0:
                    out.resume[j] = self.resumes[j]
            if end == self.pauses[j] and end < p:
                out.snap[j] = self.snaps[j]
            block0 = first // BLOCK - s // BLOCK  # this chunk's first block, counted from the row's first computed
            for b in range(min(per, (end - first) // BLOCK)):  # its whole blocks only
                if 0 <= block0 + b < len(self.writes[j]) and self.writes[j][block0 + b] >= 0:
                    out.write[j, b] = self.writes[j][block0 + b]
            if row.target_ids is not None:  # row t of target_ids predicts prompt token t + 1
                t = row.target_ids[first:end]
                out.targets[j, : len(t), : t.shape[1]] = t
        assert nb == out.read.shape[1]
        return out


def choose(rows: list[SampleRow], queue: deque[int], count: int, caching: bool) -> list[int]:
    """Up to `count` rows from the front of `queue` (removed from it); rows that would find a taken row's blocks in
    the cache at the next admission stay queued, in order."""
    chosen: list[int] = []
    firsts: set[tuple] = set()
    deferred: list[int] = []
    while queue and len(chosen) < count:
        i = queue.popleft()
        row = rows[i]
        key = None
        if caching and row.cache_namespace is not None and len(row.prompt) > BLOCK:
            key = (row.cache_namespace, row.prompt[:BLOCK].tobytes())
        if key is not None and key in firsts:
            deferred.append(i)
            continue
        if key is not None:
            firsts.add(key)
        chosen.append(i)
    queue.extendleft(reversed(deferred))
    return chosen


def plan(rows: list[SampleRow], chosen: list[int], slots: list[int], index: PrefixIndex | None) -> Admission:
    """Where each chosen row's prompt starts in the prefix cache, and the pool blocks its computed whole blocks go
    to (registered now: the admission that writes them is done before any later one reads them)."""
    cached: list[list[int]] = []
    for i in chosen:
        row = rows[i]
        if index is None or row.cache_namespace is None:
            cached.append([])
        else:
            cached.append(
                index.lookup(row.cache_namespace, row.prompt, min(row.needs_from, len(row.prompt) - 1), row.image_spans)
            )
    if index is not None:
        index.hits += sum(len(c) for c in cached) * BLOCK
    pinned = {b for c in cached for b in c}
    writes, resumes, pauses, snaps = [], [], [], []
    for i, c in zip(chosen, cached):
        row = rows[i]
        ok = index is not None and row.cache_namespace is not None
        w = index.plan_writes(row.cache_namespace, row.prompt, c, pinned, row.image_spans) if ok else []  # type: ignore[union-attr]
        writes.append(w)
        recurrent = ok and index.states > 0  # type: ignore[union-attr]
        resumes.append(index.state_of(c[-1]) if recurrent and c else -1)  # type: ignore[union-attr]
        # The boundary a prompt like this one resumes from: the last one before its last token.
        pause, snap = (len(row.prompt) - 1) // BLOCK * BLOCK, -1
        b = pause // BLOCK - 1 - len(c)  # the block ending there, among this row's writes
        if recurrent and 0 <= b < len(w) and w[b] >= 0:
            snap = index.plan_state(w[b], pinned)  # type: ignore[union-attr]
            pinned.add(w[b])  # its state slot is this admission's to write: no later row of it takes that
        pauses.append(pause if snap >= 0 else 0)
        snaps.append(snap)
    return Admission(
        chosen=chosen,
        slots=slots,
        starts=[len(c) * BLOCK for c in cached],
        read=cached,
        writes=writes,
        resumes=resumes,
        pauses=pauses,
        snaps=snaps,
        wants=(
            any(rows[i].prompt_logprobs for i in chosen),
            any(rows[i].target_ids is not None for i in chosen),
            any(rows[i].prompt_alt_tokens_k > 0 for i in chosen),
        ),
    )


def blank(r: int, c: int, cache_len: int, slots: int, pool_blocks: int, scoring: bool = False) -> Chunk:
    """A chunk of padding rows only (the arrays every chunk starts from, and what a compile runs on); a scoring
    one has room for MAX_TARGET_PROMPT_LOGPROBS target ids per position."""
    return Chunk(
        chunk=np.zeros((r, c), np.int32),
        nexts=np.full((r, c), -1, np.int32),
        start=np.zeros((r,), np.int32),
        prompt_len=np.ones((r,), np.int32),
        index=np.full((r,), slots, np.int32),
        final=np.zeros((r,), bool),
        cached=np.zeros((r,), np.int32),
        read=np.zeros((r, cache_len // BLOCK), np.int32),
        write=np.full((r, c // BLOCK), pool_blocks, np.int32),
        targets=np.full((r, c, MAX_TARGET_PROMPT_LOGPROBS if scoring else 0), -1, np.int32),
        resume=np.full((r,), NO_STATE, np.int32),
        snap=np.full((r,), NO_STATE, np.int32),
    )


def row_params(rows: list[SampleRow], r: int) -> RowParams:
    """The sampling settings of an admission's rows, padded to `r` rows (numpy leaves; the caller places them)."""
    n = len(rows)
    stop_ids: Any = np.full((r, STOP_IDS), -1, np.int32)
    for i, row in enumerate(rows):
        stop_ids[i, : len(row.stop_ids)] = row.stop_ids

    def col(values, pad, dtype) -> Any:
        return np.array(list(values) + [pad] * (r - n), dtype)

    return RowParams(
        temperature=col((x.temperature for x in rows), 1.0, np.float32),
        top_k=col((x.top_k for x in rows), -1, np.int32),
        top_p=col((x.top_p for x in rows), 1.0, np.float32),
        seed=col((x.seed for x in rows), (0, 0), np.uint32).reshape(r, 2),
        sample_index=col((x.sample_index for x in rows), 0, np.int32),
        max_tokens=col((x.max_tokens for x in rows), 1, np.int32),
        stop_ids=stop_ids,
        topk=col((x.topk_sample_logprobs for x in rows), 0, np.int32),
    )
