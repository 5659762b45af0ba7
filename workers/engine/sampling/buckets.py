"""The sampler's shapes: the few sizes its programs are compiled for, whatever the requests.

A sampler program's shapes are (slot bucket, cache length, stop-id width, adapter-stack size, top-k width) and, for
an admission, its rows and chunk, which follow from the slot bucket and the cache length. None depends on a prompt's
length or on where it starts in the prefix cache: prompts are prefilled in chunks (admission.py). So the set of
programs is fixed per model and device once its families are (docs/architecture.md §The bounded program set).
"""

from __future__ import annotations

from ..model.config import round_up_cache_len
from ..runtime.sharding import DeviceLayout
from .prefix_cache import BLOCK
from .rows import SampleRow

# Largest number of decode slots (rows decoded together); smaller buckets are powers of 8 below it.
DEFAULT_SAMPLE_SLOTS = 256
# Smallest KV-cache length; each larger one is four times the last (a row's cache is at most 4x what it needs).
MIN_CACHE_LEN = 128
CACHE_GROWTH = 4
# Prompt tokens per admission chunk: a quarter of the cache length, between these (multiples of BLOCK, dividing
# every cache length): short caches take short chunks, so a short prompt pays little padding.
MIN_CHUNK, MAX_CHUNK = 32, 512
# Families of caches longer than this compile only the slot bucket a batch uses at its first use, not every bucket:
# their programs take long to compile, and a long prompt's first sample should not wait for buckets it does not use.
EAGER_CACHE_LEN = 2048
# Stop token ids a row carries (its list, the model's end-of-sequence ids included, padded with -1): one width for
# every request, so a stop list never selects a program; a longer list is the request's error.
STOP_IDS = 64
# Adapter-stack sizes: the distinct sampler snapshots one decode batch routes its rows into (padded with zero
# adapters); a sample call naming more than the largest is decoded in several batches.
STACK_SIZES = (1, 4, 16)


def slot_buckets(max_slots: int, placement: DeviceLayout) -> list[int]:
    """Row buckets: powers of 8 below max_slots, then max_slots (e.g. 8, 64, 256), each a multiple of fsdp."""
    out, b = [], 8
    while b < max_slots:
        out.append(b)
        b *= 8
    out.append(max_slots)
    return sorted({placement.round_rows(x) for x in out})


def admission_rows(slots: int, placement: DeviceLayout) -> int:
    """Rows per admission call (slots / 8): filling every slot takes 8 calls, a refill one; one program per bucket."""
    return placement.round_rows(max(1, slots // 8))


def chunk_len(cache_len: int) -> int:
    """Prompt tokens one admission call prefills per row, for caches of `cache_len`: the largest power of two within
    a quarter of it, between MIN_CHUNK and MAX_CHUNK."""
    quarter = max(1, cache_len // 4)
    return max(MIN_CHUNK, min(MAX_CHUNK, 1 << (quarter.bit_length() - 1)))


def cache_buckets(context: int) -> list[int]:
    """Every cache length a model of `context` positions samples with: MIN_CACHE_LEN times powers of CACHE_GROWTH
    below the context, then the context itself rounded up to a whole chunk."""
    out, n = [], MIN_CACHE_LEN
    while n < context:
        out.append(n)
        n = round_up_cache_len(n + 1, MIN_CACHE_LEN, CACHE_GROWTH)
    top = max(MIN_CACHE_LEN, context)
    step = chunk_len(top)
    out.append(-(-top // step) * step)
    return sorted(set(out))


def cache_bucket(need: int, context: int) -> int:
    """The cache length of rows whose longest needs `need` positions (prompt + max_tokens)."""
    return next((b for b in cache_buckets(context) if b >= need), cache_buckets(context)[-1])


def stop_width(rows: list[SampleRow]) -> int:
    """The stop-id width of rows: always STOP_IDS (sample_requests refuses a longer list)."""
    assert all(len(r.stop_ids) <= STOP_IDS for r in rows)
    return STOP_IDS


def stack_size(snapshots: int) -> int:
    """The adapter-stack size for this many distinct snapshots (at most the largest of STACK_SIZES)."""
    return next(s for s in STACK_SIZES if s >= min(max(1, snapshots), STACK_SIZES[-1]))


assert MIN_CHUNK % BLOCK == 0 and MAX_CHUNK % BLOCK == 0 and MIN_CACHE_LEN % MIN_CHUNK == 0
