"""The sampler's shapes: the few sizes its programs are compiled for, whatever the requests.

A sampler program's shapes follow from its *slot bucket* alone: the bucket fixes the number of decode slots, their
KV-cache length, the rows of one admission and the tokens of one prompt chunk. Every bucket holds about the same
KV tokens (`slot_tokens`, the largest bucket's slots times SLOT_CACHE_LEN, less where the memory plan says so), so
fewer slots get longer caches: 256 slots of 2,048 positions, 64 of 8,192, 8 of up to 65,536. Attention reads only
the key blocks a row has filled (model/cached_attention.py), so a short row in a long cache costs what it holds.
Stop lists, top-k logprobs and prompt scoring are data of fixed widths, never a shape; what still selects a program
is the adapter-stack size (STACK_SIZES) and, for an admission, whether it scores prompts (docs/architecture.md
§The bounded program set counts them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..model.sharding import DeviceLayout
from .prefix_cache import BLOCK

# Largest number of decode slots (rows decoded together); smaller buckets are powers of 8 below it.
DEFAULT_SAMPLE_SLOTS = 256
# The KV-cache length of the largest slot bucket: what a full batch of RL rollouts (prompt + max_tokens) usually
# needs. Its slots times this is the KV tokens every bucket holds (fewer where the memory plan says so).
SLOT_CACHE_LEN = 2048
# Shortest KV cache a bucket may have; a bucket whose share would be shorter is left out.
MIN_CACHE_LEN = 128
# Prompt tokens per admission chunk: a quarter of the cache length, between these (multiples of BLOCK): short caches
# take short chunks, so a short prompt pays little padding.
MIN_CHUNK, MAX_CHUNK = 32, 512
# Stop token ids a row carries (its list, the model's end-of-sequence ids included, padded with -1): one width for
# every request, so a stop list never selects a program; a longer list is the request's error.
STOP_IDS = 64
# Adapter-stack sizes: the distinct sampler snapshots one decode batch routes its rows into (padded with zero
# adapters); a sample call naming more than the largest is decoded in several batches.
STACK_SIZES = (1, 4, 16)


@dataclass(frozen=True)
class SlotBucket:
    """One slot bucket: `slots` rows decoded together, each with `cache_len` positions of KV cache, admitted
    `rows` at a time in prompt chunks of `chunk` tokens."""

    slots: int
    cache_len: int
    rows: int
    chunk: int

    @property
    def label(self) -> str:
        return f"slots={self.slots} cache={self.cache_len}"


def chunk_len(cache_len: int) -> int:
    """Prompt tokens one admission call prefills per row, for caches of `cache_len`: the largest power of two within
    a quarter of it, between MIN_CHUNK and MAX_CHUNK."""
    quarter = max(1, cache_len // 4)
    return max(MIN_CHUNK, min(MAX_CHUNK, 1 << (quarter.bit_length() - 1)))


def _whole_chunks(n: int) -> int:
    step = chunk_len(n)
    return -(-n // step) * step


def slot_tokens(max_slots: int, kv_tokens: int | None = None) -> int:
    """KV tokens one bucket's slots hold: max_slots x SLOT_CACHE_LEN, or what the memory plan fits when less."""
    want = max_slots * SLOT_CACHE_LEN
    return want if kv_tokens is None else max(MIN_CACHE_LEN, min(want, kv_tokens))


def slot_buckets(
    max_slots: int,
    context: int,
    placement: DeviceLayout,
    kv_tokens: int | None = None,
    prefill_rows: Callable[[int, int, int], int] | None = None,
) -> list[SlotBucket]:
    """The buckets, fewest slots first: powers of 8 below `max_slots` and `max_slots` itself (8, 64, 256), each
    with its share of `slot_tokens` as its cache length (at most the context), and one slot of the whole context
    first when 8 slots' share is shorter than the context. `prefill_rows(chunk, slots, cache)` (the memory plan's)
    caps an admission's rows."""
    tokens = slot_tokens(max_slots, kv_tokens)
    top = _whole_chunks(max(MIN_CACHE_LEN, context))
    counts, b = [], 8
    while b < max_slots:
        counts.append(b)
        b *= 8
    counts.append(max_slots)
    out: dict[int, SlotBucket] = {}
    for n in sorted({placement.round_rows(x) for x in counts}):
        length = min(top, _whole_chunks(tokens // n))
        if length >= MIN_CACHE_LEN:
            out[n] = _bucket(n, length, placement, prefill_rows)
    longest = max((b.cache_len for b in out.values()), default=0)
    n = placement.round_rows(1)
    if longest < top and n not in out:  # rows longer than 8 slots' share: a bucket of fewer slots holds them
        length = min(top, _whole_chunks(max(MIN_CACHE_LEN, tokens // n)))
        if length > longest:
            out[n] = _bucket(n, length, placement, prefill_rows)
    return [out[n] for n in sorted(out)]


def _bucket(
    slots: int, length: int, placement: DeviceLayout, prefill_rows: Callable[[int, int, int], int] | None
) -> SlotBucket:
    c = chunk_len(length)
    rows = placement.round_rows(max(1, slots // 8))  # filling every slot takes 8 admissions, a refill one
    if prefill_rows is not None:
        fit = prefill_rows(c, slots, length)
        rows = min(rows, placement.round_rows(1 << (max(1, fit).bit_length() - 1)))
    return SlotBucket(slots=slots, cache_len=length, rows=rows, chunk=c)


def pick_bucket(buckets: list[SlotBucket], rows: int, need: int) -> SlotBucket:
    """The bucket for `rows` rows whose longest needs `need` positions: among those whose caches hold it, the
    smallest with a slot per row, else the one with most slots (rows then queue for slots); when no cache holds
    it, the longest (sample_requests refuses what no bucket can hold before it gets here)."""
    fits = [b for b in buckets if b.cache_len >= need]
    if not fits:
        return max(buckets, key=lambda b: b.cache_len)
    return next((b for b in fits if b.slots >= rows), fits[-1])


def stack_size(snapshots: int) -> int:
    """The adapter-stack size for this many distinct snapshots (at most the largest of STACK_SIZES)."""
    return next(s for s in STACK_SIZES if s >= min(max(1, snapshots), STACK_SIZES[-1]))


assert MIN_CHUNK % BLOCK == 0 and MAX_CHUNK % BLOCK == 0 and MIN_CACHE_LEN % MIN_CHUNK == 0
