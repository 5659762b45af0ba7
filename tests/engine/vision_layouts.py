"""The prompts every vision-language parity test packs together: one image between text; two images of different
sizes; text only. Each image sits in its own vision tokens (<|vision_start|> placeholders <|vision_end|>, the two
tokens just below the placeholder in every tiny VL tokenizer here), so the layout is what a renderer builds."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from tinkerflow.common.images import ImageProcessing, ProcessedImage, decode_image, model_image_processor, preprocess
from tinkerflow.workers.engine.types import Datum


def noise_png(height: int, width: int, seed: int) -> bytes:
    """A PNG of uniform noise: an image no two seeds share."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def processed_images(model: Path, sizes: list[tuple[int, int]]) -> list[ProcessedImage]:
    """Noise PNGs of these (height, width), seeded by their place, cut by the model's own image processor."""
    processing = ImageProcessing.from_hf(model_image_processor(model) or {})
    return [preprocess(decode_image(noise_png(h, w, i), "png"), processing) for i, (h, w) in enumerate(sizes)]


def layouts(
    image_id: int, images: list[ProcessedImage], rng: np.random.Generator, vocab: int
) -> list[tuple[np.ndarray, tuple[ProcessedImage, ...]]]:
    """(tokens, their images) of the three prompts; `images`: at least three; text tokens drawn below `vocab`."""
    start, end = image_id - 2, image_id - 1  # <|vision_start|>, <|vision_end|>

    def text(n: int) -> list[int]:
        return rng.integers(0, vocab, n).tolist()

    def image(k: int) -> list[int]:
        return [start] + [image_id] * images[k].tokens + [end]

    out = [
        (text(5) + image(0) + text(6), (images[0],)),
        (text(3) + image(1) + text(2) + image(2) + text(4), (images[1], images[2])),
        (text(23), ()),
    ]
    return [(np.asarray(tokens, np.int32), its) for tokens, its in out]


def next_token_datums(image_id: int, images: list[ProcessedImage], rng: np.random.Generator, vocab: int) -> list[Datum]:
    """The three prompts (one more text token each) as datums whose targets are the next tokens, weighted on text."""
    data = []
    for tokens, its in layouts(image_id, images, rng, vocab):
        full = np.concatenate([tokens, rng.integers(0, vocab, 1).astype(np.int32)])
        weights = (full[1:] != image_id).astype(np.float32)
        data.append(Datum(full[:-1], {"target_tokens": full[1:].astype(np.int64), "weights": weights}, images=its))
    return data
