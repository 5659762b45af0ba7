"""Sampling prompts with images on Qwen3.5 VL: the prefix cache keys the blocks holding an image's placeholders on
the image's digest, so the same tokens with another image never hit."""

from __future__ import annotations

import hashlib

import numpy as np

from tinkerflow.workers.engine.sampling.prefix_cache import BLOCK, PrefixIndex


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def test_prefix_blocks_holding_an_image_key_on_its_digest():
    """Same tokens, same image: every whole block hits. Same tokens, another image of the same size: the blocks
    before the image still hit, the block holding its placeholders and every one after it miss."""
    index = PrefixIndex(blocks=16)
    prompt = np.arange(4 * BLOCK + 3, dtype=np.int32)
    span = (BLOCK + 5, 2 * BLOCK + 9)  # the placeholders reach into blocks 1 and 2
    cat, dog = [(*span, _digest(b"cat"))], [(*span, _digest(b"dog"))]
    written = index.plan_writes("ns", prompt, [], set(), images=cat)
    assert written == [0, 1, 2, 3]
    assert index.lookup("ns", prompt, len(prompt) - 1, images=cat) == written
    assert index.lookup("ns", prompt, len(prompt) - 1, images=dog) == written[:1]
    assert index.lookup("ns", prompt, len(prompt) - 1) == written[:1]  # no image at all: the text-only key
    again = index.plan_writes("ns", prompt, written[:1], set(), images=dog)
    assert len(again) == 3 and not set(again) & set(written)  # the other image's blocks are its own
    assert index.lookup("ns", prompt, len(prompt) - 1, images=dog) == [written[0], *again]
