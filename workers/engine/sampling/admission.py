"""One admission, host side: which queued rows go in together, where their prompts start in the prefix cache, and
the arrays `decode.admit` takes for them.

Rows are taken from the front of the queue; a row whose prompt starts like one already taken (same cache namespace,
same first block) waits for the next admission, where it finds that row's blocks in the cache: the samples of one
request (a GRPO group) prefill their prompt once, and the others only its last partial block. A row's prompt starts
in the cache up to the block before the first position whose hidden state it needs (`SampleRow.needs_from`: its last
token to sample from, earlier ones when it scores the prompt).

The part of the prompts an admission computes after its rows' cached blocks is padded to a *suffix bucket*: the
smallest bucket or a prompt bucket the warm-up compiled (`suffix_buckets`), below the whole prompt's, so a workload
with prefix hits runs programs the warm-up built. Where none holds the suffix, a family the warm-up built prefills
whole prompts instead (its rows take nothing from the cache: no program is compiled mid-workload), and any other
family computes the suffix in its own bucket (its programs are compiled at first use anyway). A suffix only the
whole prompt's bucket holds saves no compute: whole prompts too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from ..model.config import round_up_pow2, round_up_seq_len
from .prefix_cache import BLOCK, PrefixIndex
from .rows import SampleRow


@dataclass
class Admission:
    chosen: list[int]  # rows, in the order of the arrays
    starts: list[int]  # prompt tokens each chosen row takes from the cache
    prompt: np.ndarray  # int32 [R, S]: each row's prompt from its start on
    prompt_len: np.ndarray  # int32 [R]: whole prompt lengths
    start: np.ndarray  # int32 [R]
    read: np.ndarray  # int32 [R, NB]
    write: np.ndarray  # int32 [R, NB]
    targets: np.ndarray  # int32 [R, S - 1, K]
    prefix: bool  # some row starts in the cache
    prompt_logprobs: bool
    alt_k: int

    @property
    def suffix_len(self) -> int:
        return int(self.prompt.shape[1])


def suffix_buckets(full: int, warmed: Collection[int]) -> list[int]:
    """The suffix buckets an admission of whole prompts of `full` tokens may compute when its rows start in the
    cache: the smallest bucket and the `warmed` prompt buckets, below `full`."""
    return sorted(s for s in {round_up_seq_len(1), *warmed} if s < full)


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


def plan(rows: list[SampleRow], chosen: list[int], r: int, full: int, index: PrefixIndex | None,
         pool_blocks: int, warmed: Collection[int] = ()) -> Admission:  # fmt: skip
    """The arrays of one admission of `chosen` padded to `r` rows, whose whole prompts fit `full` tokens; the part
    computed after cached blocks is padded to a suffix bucket (module docstring), `warmed` the warm-up's."""
    nb = -(-full // BLOCK)
    cached: list[list[int]] = []
    for i in chosen:
        row = rows[i]
        if index is None or row.cache_namespace is None:
            cached.append([])
        else:
            cached.append(index.lookup(row.cache_namespace, row.prompt, min(row.needs_from, len(row.prompt) - 1)))
    slen = full
    if any(cached):
        suffix = round_up_seq_len(max(len(rows[i].prompt) - len(c) * BLOCK for i, c in zip(chosen, cached)))
        # A suffix bucket the warm-up built; in a family it built, whole prompts rather than a program it did not
        # (a family it did not build compiles anyway: there the suffix's own bucket).
        fits = [b for b in suffix_buckets(full, warmed) if b >= suffix]
        slen = fits[0] if fits else full if full in warmed else suffix
        if slen >= full:  # the cache would save nothing: whole prompts, and their blocks are not read
            slen, cached = full, [[] for _ in chosen]
    if index is not None:
        index.hits += sum(len(c) for c in cached) * BLOCK
    pinned = {b for c in cached for b in c}
    starts = [len(c) * BLOCK for c in cached]
    prefix = any(starts)
    kg = max((t.shape[1] for i in chosen if (t := rows[i].target_ids) is not None), default=0)
    kg = round_up_pow2(kg) if kg else 0
    alt = max((rows[i].prompt_alt_tokens_k for i in chosen), default=0)
    prompt, prompt_len = np.zeros((r, slen), np.int32), np.ones((r,), np.int32)
    start = np.zeros((r,), np.int32)
    read = np.zeros((r, nb), np.int32)
    write = np.full((r, nb), pool_blocks, np.int32)  # out of range: nothing written
    targets = np.full((r, slen - 1, kg), -1, np.int32)
    for j, (i, c, s) in enumerate(zip(chosen, cached, starts)):
        row = rows[i]
        prompt[j, : len(row.prompt) - s] = row.prompt[s:]
        prompt_len[j], start[j] = len(row.prompt), s
        read[j, : len(c)] = c
        if index is not None and row.cache_namespace is not None:
            for b, block in enumerate(index.plan_writes(row.cache_namespace, row.prompt, c, pinned), start=len(c)):
                if block >= 0:
                    write[j, b] = block
        if row.target_ids is not None:
            t = row.target_ids[s:]
            targets[j, : len(t), : t.shape[1]] = t
    return Admission(
        chosen=chosen, starts=starts, prompt=prompt, prompt_len=prompt_len, start=start, read=read, write=write,
        targets=targets, prefix=prefix, prompt_logprobs=any(rows[i].prompt_logprobs for i in chosen),
        alt_k=round_up_pow2(alt) if alt else 0,
    )  # fmt: skip


def blank(r: int, full: int, pool_blocks: int, suffix: int | None = None) -> Admission:
    """An admission of no rows, to compile its program: whole prompts of `full` tokens, or (`suffix`) rows that
    start in the cache and compute `suffix` tokens of them."""
    adm = plan([], [], r, full, None, pool_blocks)
    if suffix is not None:
        adm.prompt = np.zeros((r, suffix), np.int32)
        adm.targets = np.full((r, suffix - 1, 0), -1, np.int32)
        adm.prefix = True
    return adm
