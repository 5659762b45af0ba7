"""The shape buckets the jitted steps compile for: sequence lengths, rows and cache lengths rounded so that the
number of compiled programs stays small whatever the requests' sizes."""

from __future__ import annotations


def round_up_seq_len(n: int, minimum: int = 16) -> int:
    """Round up to two significant binary digits (16, 24, 32, 48, 64, 96, ...), as SkyRL does.

    Padding to these buckets bounds the number of jit compiles at ~2 per power of two while wasting at most a third.
    """
    n = max(n, minimum)
    shift = max(n.bit_length() - 2, 0)
    step = 1 << shift
    return -(-n // step) * step


# Training rows are 256 x 4^k tokens long up to 4,096 (PACK_TOKENS: packed rows are mostly full, a lone datum pads
# at most 4x), so datums of 1..4,096 tokens run three lengths; longer ones round to two significant bits, the
# buckets the memory plan's limits are.
MIN_TRAIN_SEQ, TRAIN_SEQ_TOP = 256, 4096


def train_seq_len(n: int, limit: int | None = None) -> int:
    """The row length of a training micro-batch whose rows need `n` tokens (see above); where a 4x bucket would pass
    `limit` (the memory plan's most tokens per row), the two-significant-bit one."""
    b = MIN_TRAIN_SEQ
    while b < n:
        b *= 4
    if n <= TRAIN_SEQ_TOP and (limit is None or b <= limit):
        return b
    return round_up_seq_len(n)


def round_up_pow4(n: int, cap: int | None = None) -> int:
    """The smallest power of four >= n (rows of a micro-batch, target widths), at most `cap` when given."""
    out = 1
    while out < n:
        out *= 4
    return out if cap is None else max(n, min(out, cap))


def round_down_seq_len(n: int, minimum: int = 16) -> int:
    """The largest bucket of `round_up_seq_len` that is at most n (at least `minimum`)."""
    if n <= minimum:
        return minimum
    top = 1 << (n.bit_length() - 1)
    return top + top // 2 if n >= top + top // 2 and top >= 2 else top


def round_up_cache_len(n: int, minimum: int = 128, growth: int = 4) -> int:
    """The sampler's KV-cache lengths below a model's context: `minimum` times powers of `growth` (128, 512, 2,048,
    8,192, ...; sampling/buckets.py adds the context itself as the last)."""
    out = minimum
    while out < n:
        out *= growth
    return out


def round_up_pow2(n: int, minimum: int = 1) -> int:
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


# The prefix cache's geometry, here because the memory plan (runtime) sizes the pool that sampling/ keeps.
# Tokens per cached block: prompts share whole blocks only.
BLOCK = 16
# A recurrent model's pool keeps one state snapshot per this many blocks (sampling/prefix_cache.py): a snapshot is
# the size of a decode slot's states, hundreds of blocks' keys and values on real models, and a prompt needs one.
STATE_EVERY = 4


def state_slots(blocks: int) -> int:
    """The state snapshots a recurrent model's pool of `blocks` blocks keeps."""
    return max(1, blocks // STATE_EVERY)


# A batch's image patches (all its images side by side for the vision tower) are padded to 256 x 4^k rows, so the
# tower's programs are a few per row bucket whatever the images' sizes (a 1024 x 1024 image at patch 16 is 4,096).
MIN_IMAGE_PATCHES = 256


def image_patch_len(n: int, merge_unit: int = 4) -> int:
    """The padded patch count of a batch whose images have `n` patches: 256 x 4^k, at least n (a multiple of
    `merge_unit`, the patches one feature merges)."""
    out = MIN_IMAGE_PATCHES
    while out < n:
        out *= 4
    if out % merge_unit:
        raise ValueError(f"patch bucket {out} is not a multiple of merge_unit={merge_unit}")
    return out
