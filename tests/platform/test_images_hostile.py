"""Hostile bytes into tinkerflow.common.images: whatever arrives as an ImageChunk's data, decoding and preprocessing
either succeed or raise InputError (a ValueError of category `user`), never another exception.

Hypothesis draws arbitrary bytes, and valid PNG/JPEG files with bytes flipped, cut short or spliced, so the decoders
get past their signature checks into the chunks and scans where corruption does its work."""

from __future__ import annotations

import io

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from tinkerflow.common.errors import InputError
from tinkerflow.common.images import ImageProcessing, decode_image, preprocess

PROCESSING = ImageProcessing(min_pixels=32 * 32, max_pixels=64 * 64)


def _valid(fmt: str, mode: str) -> bytes:
    rng = np.random.default_rng(0)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = rng.integers(0, 256, size=(24, 40, channels), dtype=np.uint8).squeeze()
    out = io.BytesIO()
    Image.fromarray(array, mode=mode).save(out, format=fmt.upper())
    return out.getvalue()


SEEDS = {("png", "RGB"), ("png", "RGBA"), ("png", "L"), ("jpeg", "RGB"), ("jpeg", "L")}
VALID = {key: _valid(*key) for key in SEEDS}


@st.composite
def damaged(draw) -> tuple[bytes, str]:
    fmt, mode = draw(st.sampled_from(sorted(SEEDS)))
    data = bytearray(VALID[(fmt, mode)])
    for _ in range(draw(st.integers(0, 8))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    cut = draw(st.integers(8, len(data)))
    tail = draw(st.binary(max_size=64))
    return bytes(data[:cut]) + tail, draw(st.sampled_from([fmt, fmt, "png" if fmt == "jpeg" else "jpeg"]))


def _decode_and_preprocess(data: bytes, fmt: str) -> None:
    try:
        image = decode_image(data, fmt, max_pixels=4_000_000)
    except InputError:
        return
    try:
        processed = preprocess(image, PROCESSING)
    except InputError:
        return
    assert processed.patches.shape == (processed.grid[1] * processed.grid[2], PROCESSING.patch_dim)
    assert np.isfinite(processed.patches).all()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512), st.sampled_from(["png", "jpeg", "gif", ""]))
def test_arbitrary_bytes_fail_only_as_input_errors(data, fmt):
    _decode_and_preprocess(data, fmt)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damaged())
def test_damaged_images_fail_only_as_input_errors(case):
    _decode_and_preprocess(*case)
