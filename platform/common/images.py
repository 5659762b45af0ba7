"""Images as Qwen's vision-language models take them: decode png/jpeg bytes, resize, normalise and cut into patches
exactly as transformers' `Qwen2VLImageProcessorPil` does (the image processor Qwen3-VL and Qwen3.5 name), and the
number of placeholder tokens an image becomes (what an `ImageChunk`'s `expected_tokens` is checked against).

numpy and PIL only, no JAX and no torch: the API counts an image's tokens to fail a wrong `expected_tokens` fast,
and the engine's worker turns the same bytes into the patch rows its vision tower reads.

The steps, each the processor's own:

* decode: only the format the chunk declares (a JPEG sent as `png` is refused), EXIF orientation applied as
  transformers' `load_image` does, transparency composited onto white and converted to RGB (`convert_to_rgb`);
* `smart_resize`: each side rounded to a multiple of `patch_size * merge_size` (the factor), then scaled so the area
  lies within [min_pixels, max_pixels] with the aspect ratio kept as closely as possible; PIL bicubic resampling;
* rescale by 1/255 (computed in float64, stored float32) and normalise by the per-channel mean and std (float32);
* patchify: [grid_h * grid_w, channels * temporal_patch_size * patch_size**2] rows, ordered by `merge_size` x
  `merge_size` blocks (the order the vision tower's merger and 2-D positions assume); a still image is its own frame
  repeated `temporal_patch_size` times. Its grid is (1, grid_h, grid_w) and it becomes
  grid_h * grid_w / merge_size**2 tokens.

Bad bytes are the caller's fault: every failure is an `InputError` (a ValueError of category `user`) naming the field
or the limit, never another exception, whatever the bytes (tests/platform/test_images_hostile.py).
"""

from __future__ import annotations

import io
import json
import math
import pathlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from tinkerflow.common.errors import InputError

FORMATS = {"png": "PNG", "jpeg": "JPEG"}  # ImageChunk.format -> PIL's format name
MAX_IMAGE_BYTES = 20 * 1024 * 1024
# Decoded width x height, checked from the header before any pixel is decoded: twice the most Qwen's processor keeps
# (4096 x 4096), so a photo from any phone camera passes and a 40-megapixel scan is refused before 120 MB of RGB.
MAX_IMAGE_PIXELS = 2 * 4096 * 4096
MAX_IMAGES_PER_DATUM = 16  # each image's tower pass is a forward of its own: a bound on one datum's work
MAX_ASPECT_RATIO = 200  # smart_resize's own limit


@dataclass(frozen=True, slots=True)
class ImageProcessing:
    """The image processor's settings (a checkpoint's preprocessor_config.json); the defaults are what Qwen3.5's
    releases ship, as Qwen3-VL's (patch 16, merge 2, temporal patch 2, mean = std = 0.5, 256 * 256 to 4096 * 4096
    pixels)."""

    min_pixels: int = 65_536
    max_pixels: int = 16_777_216
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        for name in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels={self.min_pixels} exceeds max_pixels={self.max_pixels}")
        if len(self.image_mean) != 3 or len(self.image_std) != 3 or not all(self.image_std):
            raise ValueError(f"image_mean {self.image_mean} and image_std {self.image_std} need 3 channels, std != 0")

    @property
    def factor(self) -> int:
        """What each resized side is a multiple of: one merged token's side in pixels."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Values per patch row: RGB x temporal_patch_size x patch_size**2."""
        return 3 * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ImageProcessing:
        """From a parsed preprocessor_config.json (or a processor_config.json, its settings under
        `image_processor`); ValueError names a setting this module would not follow."""
        config = config.get("image_processor") or config
        kind = config.get("image_processor_type", "Qwen2VLImageProcessor")
        if not str(kind).startswith("Qwen2VLImageProcessor"):
            raise ValueError(f"image_processor_type {kind!r} is not the Qwen2-VL image processor")
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if not config.get(flag, True):
                raise ValueError(f"{flag}=false is not supported")
        if int(config.get("resample", 3)) != Image.Resampling.BICUBIC:
            raise ValueError(f"resample={config['resample']} is not supported (only 3, bicubic)")
        size = config.get("size") or {}
        default = cls()
        return cls(
            min_pixels=int(config.get("min_pixels") or size.get("shortest_edge") or default.min_pixels),
            max_pixels=int(config.get("max_pixels") or size.get("longest_edge") or default.max_pixels),
            patch_size=int(config.get("patch_size", default.patch_size)),
            temporal_patch_size=int(config.get("temporal_patch_size", default.temporal_patch_size)),
            merge_size=int(config.get("merge_size", default.merge_size)),
            image_mean=tuple(float(v) for v in config.get("image_mean", default.image_mean)),  # type: ignore[arg-type]
            image_std=tuple(float(v) for v in config.get("image_std", default.image_std)),  # type: ignore[arg-type]
            rescale_factor=float(config.get("rescale_factor", default.rescale_factor)),
        )


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    """One image as the vision tower reads it: `patches` float32 [grid_h * grid_w, patch_dim] and `grid`
    (temporal, height, width) in patches."""

    patches: np.ndarray
    grid: tuple[int, int, int]
    merge_size: int

    @property
    def tokens(self) -> int:
        return image_tokens(self.grid, self.merge_size)


def smart_resize(height: int, width: int, processing: ImageProcessing) -> tuple[int, int]:
    """The resized (height, width): multiples of `processing.factor`, area within [min_pixels, max_pixels], aspect
    ratio kept as closely as possible (transformers' `smart_resize`, step for step)."""
    factor, min_pixels, max_pixels = processing.factor, processing.min_pixels, processing.max_pixels
    if min(height, width) < 1:
        raise InputError(f"image is {width}x{height} pixels: both sides must be at least 1")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InputError(
            f"image is {width}x{height} pixels: its aspect ratio must be at most {MAX_ASPECT_RATIO}, "
            f"got {max(height, width) / min(height, width):.1f}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(height: int, width: int, processing: ImageProcessing) -> tuple[int, int, int]:
    """(temporal, height, width) in patches of an image of `height` x `width` pixels after resizing."""
    h, w = smart_resize(height, width, processing)
    return 1, h // processing.patch_size, w // processing.patch_size


def image_tokens(grid: tuple[int, int, int], merge_size: int) -> int:
    """The placeholder tokens an image of patch grid `grid` becomes: one per merge_size x merge_size block."""
    t, h, w = grid
    return t * h * w // merge_size**2


def token_count(height: int, width: int, processing: ImageProcessing) -> int:
    """What transformers' `get_number_of_image_patches(height, width) // merge_size**2` answers (the cookbook's
    `expected_tokens`)."""
    return image_tokens(image_grid(height, width, processing), processing.merge_size)


def decode_image(
    data: bytes, fmt: str, *, max_bytes: int = MAX_IMAGE_BYTES, max_pixels: int = MAX_IMAGE_PIXELS
) -> Image.Image:
    """The RGB image in `data`, of format `fmt` ("png" or "jpeg"), EXIF orientation applied; InputError when the
    bytes are too many, not an image of that format, truncated or corrupt, or the image larger than `max_pixels`
    (checked from its header, before decoding)."""
    if fmt not in FORMATS:
        raise InputError(f"image format {fmt!r} is not supported (expected one of {', '.join(FORMATS)})")
    if len(data) > max_bytes:
        raise InputError(f"image data is {len(data)} bytes, over the limit of {max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own pixel limit is checked below
            image = Image.open(io.BytesIO(data), formats=[FORMATS[fmt]])
            width, height = image.size
            if width * height > max_pixels:
                raise InputError(f"image is {width}x{height} pixels, over the limit of {max_pixels} pixels")
            image.load()
            image = ImageOps.exif_transpose(image)
            return _to_rgb(image)
    except InputError:
        raise
    except Image.DecompressionBombError as exc:  # PIL's own ceiling, far above ours, refused before our check
        raise InputError(f"image is over the limit of {max_pixels} pixels ({exc})") from exc
    except Exception as exc:  # a C decoder fed hostile bytes fails in many ways; each is the sender's fault
        raise InputError(f"image data is not a valid {fmt} image ({type(exc).__name__}: {exc})") from exc


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (transformers' `convert_to_rgb`)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def preprocess(image: Image.Image, processing: ImageProcessing) -> ProcessedImage:
    """An RGB image (`decode_image`'s) as patch rows and grid (module docstring)."""
    height, width = smart_resize(image.height, image.width, processing)
    resized = np.asarray(image.resize((width, height), resample=Image.Resampling.BICUBIC))  # [H, W, 3] uint8
    pixels = (resized.astype(np.float64) * processing.rescale_factor).astype(np.float32)
    mean = np.asarray(processing.image_mean, np.float32)
    std = np.asarray(processing.image_std, np.float32)
    chw = np.moveaxis((pixels - mean) / std, -1, 0)  # [3, H, W]
    p, m, t = processing.patch_size, processing.merge_size, processing.temporal_patch_size
    gh, gw = height // p, width // p
    blocks = chw.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # [gh/m, gw/m, m, m, C, p, p]
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    patches = np.ascontiguousarray(frames.reshape(gh * gw, processing.patch_dim), dtype=np.float32)
    return ProcessedImage(patches=patches, grid=(1, gh, gw), merge_size=m)


def check_expected_tokens(expected: int | None, actual: int, *, field: str = "expected_tokens") -> None:
    """InputError when a chunk's `expected_tokens` is given and differs from the tokens its image becomes."""
    if expected is not None and expected != actual:
        raise InputError(f"{field}={expected} but the image becomes {actual} tokens")


def image_chunk_tokens(
    data: bytes, fmt: str, expected_tokens: int | None, processing: ImageProcessing, **limits: int
) -> int:
    """The tokens an ImageChunk's image becomes, decoded whole so bad bytes fail where the chunk arrives (`limits`:
    decode_image's max_bytes, max_pixels); InputError when `expected_tokens` is given and differs."""
    image = decode_image(data, fmt, **limits)
    tokens = token_count(image.height, image.width, processing)
    check_expected_tokens(expected_tokens, tokens)
    return tokens


def model_image_processor(model_dir: str | pathlib.Path) -> dict[str, Any] | None:
    """A served checkpoint's image processor settings (its preprocessor_config.json, or processor_config.json's
    `image_processor`; {} for the defaults when it has neither), or None when its config.json has no vision tower."""
    root = pathlib.Path(model_dir)
    config = json.loads((root / "config.json").read_text())
    if not config.get("vision_config"):
        return None
    for name in ("preprocessor_config.json", "processor_config.json"):
        if (root / name).is_file():
            found = json.loads((root / name).read_text())
            return dict(found.get("image_processor") or found)
    return {}
