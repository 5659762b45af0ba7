"""tinkerflow.common.images against transformers 5.23's `Qwen2VLImageProcessorPil` (the processor Qwen3.5's and
Qwen3-VL's configs name; its PIL backend, the one an install without torchvision uses) on random images of several
sizes and aspect ratios, through both branches of smart_resize (scaled up to min_pixels, down to max_pixels).

Tolerances: pixel values 1e-6 absolute (both sides run the same float64 rescale and float32 normalisation on the
same PIL bicubic output, so they agree to float32 rounding; a wrong channel, patch or block order moves values by
order one); grids and token counts exactly equal.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from tinkerflow.common.errors import InputError
from tinkerflow.common.images import (
    MAX_IMAGE_PIXELS,
    ImageProcessing,
    check_expected_tokens,
    decode_image,
    image_chunk_tokens,
    preprocess,
    token_count,
)

PIXEL_TOL = 1e-6
# Small pixel bounds so test images cross both of smart_resize's branches (16 * 2 = 32-pixel factor)
SMALL = ImageProcessing(min_pixels=64 * 64, max_pixels=160 * 160)
SIZES = [(37, 53), (64, 64), (20, 300), (300, 20), (129, 77), (250, 190), (1, 150), (33, 31)]


def _hf_processor(processing: ImageProcessing):
    transformers = pytest.importorskip("transformers")
    return transformers.models.qwen2_vl.image_processing_pil_qwen2_vl.Qwen2VLImageProcessorPil(
        size={"shortest_edge": processing.min_pixels, "longest_edge": processing.max_pixels},
        patch_size=processing.patch_size,
        temporal_patch_size=processing.temporal_patch_size,
        merge_size=processing.merge_size,
        image_mean=list(processing.image_mean),
        image_std=list(processing.image_std),
    )


def _encoded(array: np.ndarray, fmt: str, mode: str | None = None) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array, mode=mode).save(out, format={"png": "PNG", "jpeg": "JPEG"}[fmt])
    return out.getvalue()


def _random_image(height: int, width: int, channels: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (height, width) if channels == 1 else (height, width, channels)
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


@pytest.mark.parametrize("processing", [SMALL, ImageProcessing()], ids=["small-bounds", "qwen3.5-defaults"])
@pytest.mark.parametrize("height,width", SIZES)
def test_patches_grid_and_tokens_match_transformers(processing, height, width):
    hf = _hf_processor(processing)
    image = decode_image(_encoded(_random_image(height, width, 3, height * width), "png"), "png")
    ours = preprocess(image, processing)
    theirs = hf(images=[image], return_tensors="np")
    assert ours.grid == tuple(theirs["image_grid_thw"][0])
    assert ours.patches.dtype == np.float32 and ours.patches.shape == theirs["pixel_values"].shape
    np.testing.assert_allclose(ours.patches, theirs["pixel_values"], atol=PIXEL_TOL, rtol=0)
    expected = hf.get_number_of_image_patches(height, width, images_kwargs={}) // processing.merge_size**2
    assert ours.tokens == token_count(height, width, processing) == expected


@pytest.mark.parametrize(
    "channels,mode,fmt", [(4, "RGBA", "png"), (2, "LA", "png"), (1, "L", "png"), (1, "L", "jpeg"), (3, "RGB", "jpeg")]
)
def test_modes_and_formats_match_transformers(channels, mode, fmt):
    """Transparency composited onto white, greyscale widened, JPEG decoded: as the processor given the PIL image."""
    array = _random_image(45, 70, channels, 7)
    data = _encoded(array, fmt, mode)
    ours = preprocess(decode_image(data, fmt), SMALL)
    theirs = _hf_processor(SMALL)(images=[Image.open(io.BytesIO(data))], return_tensors="np")
    assert ours.grid == tuple(theirs["image_grid_thw"][0])
    np.testing.assert_allclose(ours.patches, theirs["pixel_values"], atol=PIXEL_TOL, rtol=0)


def test_exif_orientation_is_applied():
    """A landscape JPEG tagged 'rotate 90' is portrait once decoded (transformers' load_image does the same)."""
    image = Image.fromarray(_random_image(40, 100, 3, 1))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 clockwise
    out = io.BytesIO()
    image.save(out, format="JPEG", exif=exif)
    assert decode_image(out.getvalue(), "jpeg").size == (40, 100)


def test_from_hf_reads_a_preprocessor_config():
    config = {
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast",
    }
    assert ImageProcessing.from_hf(config) == ImageProcessing()
    assert ImageProcessing.from_hf({"image_processor": config, "video_processor": {}}) == ImageProcessing()
    assert ImageProcessing.from_hf({"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14}).factor == 28
    with pytest.raises(ValueError, match="do_normalize"):
        ImageProcessing.from_hf({**config, "do_normalize": False})


def test_limits_and_bad_bytes_name_what_is_wrong():
    png = _encoded(_random_image(30, 30, 3, 0), "png")
    jpeg = _encoded(_random_image(30, 30, 3, 0), "jpeg")
    cases = [
        (lambda: decode_image(png, "gif"), "format 'gif'"),
        (lambda: decode_image(png, "png", max_bytes=100), "over the limit of 100"),
        (lambda: decode_image(png, "png", max_pixels=899), "30x30 pixels, over the limit of 899 pixels"),
        (lambda: decode_image(jpeg, "png"), "not a valid png image"),  # declared png, holds a JPEG
        (lambda: decode_image(b"hello, not an image", "png"), "not a valid png image"),
        (lambda: decode_image(png[: len(png) // 2], "png"), "not a valid png image"),  # truncated
        (lambda: decode_image(jpeg[: len(jpeg) // 2], "jpeg"), "not a valid jpeg image"),
        (lambda: token_count(1, 250, SMALL), "aspect ratio must be at most 200"),
        (lambda: check_expected_tokens(5, 4), "expected_tokens=5 but the image becomes 4 tokens"),
    ]
    for call, message in cases:
        with pytest.raises(InputError, match=message):
            call()
    check_expected_tokens(None, 4)
    check_expected_tokens(4, 4)


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height RGB pixels, with almost no pixel data behind it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 10)) + chunk(b"IEND", b"")
    )


def test_a_header_claiming_too_many_pixels_is_refused_before_decoding():
    assert MAX_IMAGE_PIXELS == 33_554_432  # 2 x 4096 x 4096: a 40-megapixel image is over it
    with pytest.raises(InputError, match="8000x8000 pixels, over the limit of 33554432 pixels"):
        decode_image(_png_header(8000, 8000), "png")
    with pytest.raises(InputError, match="over the limit of 33554432 pixels"):  # past PIL's own bomb ceiling
        decode_image(_png_header(30000, 30000), "png")


@pytest.mark.parametrize("height,width", [(37, 53), (300, 20), (129, 77)])
def test_the_cookbooks_image_chunks_carry_the_tokens_we_count(height, width):
    """tinker-cookbook's `image_to_chunk` (JPEG bytes, expected_tokens from the processor) passes our check as is;
    one token off fails it."""
    image_to_chunk = pytest.importorskip("tinker_cookbook.renderers.base").image_to_chunk  # the cookbook extra
    chunk = image_to_chunk(Image.fromarray(_random_image(height, width, 4, 3), "RGBA"), _hf_processor(SMALL))
    tokens = image_chunk_tokens(chunk.data, chunk.format, chunk.expected_tokens, SMALL)
    assert tokens == chunk.expected_tokens == token_count(height, width, SMALL)
    assert chunk.expected_tokens is not None
    with pytest.raises(InputError, match=f"expected_tokens={tokens + 1} but the image becomes {tokens} tokens"):
        image_chunk_tokens(chunk.data, chunk.format, tokens + 1, SMALL)
