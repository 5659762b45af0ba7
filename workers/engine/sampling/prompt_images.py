"""Prompts with images in the sampler, on a vision-language model (one whose config names an `image_token_id`).

A row's images go through the vision tower once, when the row is admitted and before its first chunk (`tower`: one
program per patch bucket, shape_buckets.image_patch_len, whatever the images' sizes; the admission and decode
programs keep their shapes, so the bounded program set grows by the patch buckets only). The features come to the
host with the row's 3-D rotary positions and rope delta (`RowImages`, from the family's `image_batch`, the training
batch's own layout); each prompt chunk then carries, per row, the features of the placeholders it holds and its
tokens' 3-D positions (`chunk_images`), and once prefilled the image's keys and values are in the slot and the
prefix cache like any text's (the cache keys those blocks on the image's digest: rows.image_spans).

On such a model every row runs the multimodal rope: a text row's positions are its 1-D ones on all three axes,
where it equals the text rope (transformers does the same). Decoding continues each slot at its cache position plus
the row's rope delta on all three axes (transformers' `rope_deltas`; 0 for a text row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx

from ..model.families import ModelConfig, family_named
from ..model.image_inputs import feature_width, image_token_id, tower_features
from .rows import SampleRow


def visual(graphdef: nnx.GraphDef, lora: Any, base: Any) -> tuple[nnx.GraphDef, Any]:
    """The vision tower alone, split (graph, state): its program then depends on the patch bucket only, not on the
    LoRA stack's shapes (the tower carries no LoRA)."""
    return nnx.split(nnx.merge(graphdef, lora, base).visual)


def tower(graphdef: nnx.GraphDef, state: Any, patches: jax.Array, vision: Any) -> jax.Array:
    """The tower's features [patches / merge unit, W] of one row's images, padded to a patch bucket: W the
    feature's width, its DeepStack features beside it (image_inputs.feature_width)."""
    return tower_features(*nnx.merge(graphdef, state)(patches, vision))


def blank_images(config: ModelConfig) -> Any:
    """An image batch (the family's image_batch) of no images at the smallest patch bucket: what the warm-up
    compiles the tower for."""
    batcher = family_named(config.arch).image_batch
    assert batcher is not None, "a model that takes images has its family's image_batch"
    return batcher(config, np.zeros((1, 1), np.int32), np.ones((1, 1), np.int32), ())


@dataclass(frozen=True)
class RowImages:
    """One row's images as its chunks take them."""

    features: np.ndarray  # float32 [placeholders, W]: the tower's, in placeholder order
    feature_of: np.ndarray  # int32 [P]: each prompt token's row of `features` (-1: not a placeholder)
    positions: np.ndarray  # int32 [P, 3]: the prompt's (temporal, height, width) rotary positions
    delta: int  # a generated token's rotary position minus its place in the row


def row_images(
    config: ModelConfig, row: SampleRow, run_tower: Any, start: int = 0, seen: dict | None = None
) -> RowImages | None:
    """The row's `RowImages` (None for a text row), running its images through `run_tower(patches, vision)` unless
    every placeholder is before `start` (the prefix cache holds them: the samples of one request after the first),
    or `seen` holds features of the same images (keyed by their digests: one call's rows sharing a prompt)."""
    if not row.images:
        return None
    batcher = family_named(config.arch).image_batch
    assert batcher is not None, "a model that takes images has its family's image_batch"
    p = len(row.prompt)
    batch = batcher(config, row.prompt[None], np.ones((1, p), np.int32), row.images)
    count = sum(image.tokens for image in row.images)
    is_image = row.prompt == image_token_id(config)
    feature_of = np.where(is_image, np.cumsum(is_image) - 1, -1).astype(np.int32)
    key = tuple(digest for *_, digest in row.image_spans) or None
    if not is_image[start:].any():  # no chunk reads a feature
        features = np.zeros((count, feature_width(config)), np.float32)
    elif seen is not None and key in seen:
        features = seen[key]
    else:
        features = np.asarray(run_tower(batch.patches, batch.vision), np.float32)[:count]
        if seen is not None and key is not None:
            seen[key] = features
    positions = np.asarray(batch.positions[0], np.int32)
    return RowImages(features, feature_of, positions, int(positions.max()) + 1 - p)


def chunk_images(
    chunk: Any, images: list[RowImages | None], width: int, slots: int, dtype: Any = np.float32
) -> tuple[dict[str, np.ndarray | None], np.ndarray]:
    """One admission.Chunk's (image_inputs.PromptImages fields as numpy, rope delta int32 [R]): row j's features at
    its placeholders (in `dtype`, the model's compute dtype) and its tokens' 3-D positions, the 1-D ones on every axis
    where it has no images (`images[j]` None, or a padding row: `chunk.index` out of range). `features` is None when
    no row has a placeholder in the chunk: the caller passes zeros it keeps on the device, so a text chunk of a
    vision-language model moves no R x C x H block to the device."""
    r, c = chunk.chunk.shape
    flat = chunk.start[:, None] + np.arange(c, dtype=np.int32)[None, :]
    positions = np.repeat(flat[:, :, None], 3, axis=2).astype(np.int32)
    mask = np.zeros((r, c), bool)
    features = np.zeros((r, c, width), dtype)
    delta = np.zeros((r,), np.int32)
    for j, got in enumerate(images):
        if got is None or chunk.index[j] >= slots:
            continue
        first, end = int(chunk.start[j]), int(chunk.prompt_len[j])
        n = end - first
        positions[j, :n] = got.positions[first:end]
        # Past the prompt: the positions go on from its last (those tokens' keys are overwritten before use).
        positions[j, n:] = got.positions[end - 1].max() + 1 + np.arange(c - n, dtype=np.int32)[:, None]
        at = got.feature_of[first:end]
        mask[j, :n] = at >= 0
        features[j, :n][at >= 0] = got.features[at[at >= 0]]
        delta[j] = got.delta
    return {"features": features if mask.any() else None, "mask": mask, "positions": positions}, delta
