"""A training batch's images as the causal LM reads them (`CausalLM.hidden(..., images=)`): every image of the batch
as one padded run of patch rows for the tower, and the 3-D rotary positions of every token.

Built on the host in numpy from the batch's laid-out tokens and segments (each datum one segment, its images in the
order of their placeholder runs): the images follow each other in row-major placeholder order, which is the order
`vision_merge.placeholders` numbers the placeholders, so feature k of the tower takes placeholder k.

The patch count is bucketed (shape_buckets.image_patch_len), so one program serves every mix of image sizes whose
patches fit the bucket: a compiled program per patch bucket and (rows, length), never per image size. A datum keeps
its images' placeholders inside its own segment (packing never splits a datum), and `rope_index` restarts the
positions at each segment, so datums with and without images pack together; a text-only datum's positions are
0, 1, 2, ... on all three axes, where mrope equals the text model's rope.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from tinkerflow.common.images import ProcessedImage

from ....shape_buckets import image_patch_len
from ...image_inputs import image_token_id
from .. import ModelConfig
from .vision_config import VisionConfig, VisionInputs, vision_inputs
from .vision_merge import rope_index


@functools.partial(jax.tree_util.register_dataclass, data_fields=["patches", "vision", "positions"], meta_fields=[])
@dataclass(frozen=True)
class ImageBatch:
    """`patches` float32 [P, patch_dim] (P the bucket, zero rows past the images'), `vision` the tower's per-patch
    inputs, `positions` int32 [B, T, 3] the tokens' (temporal, height, width) rotary positions (batch-leading, as
    every leaf of a training batch, so the batch's placement shards it)."""

    patches: Any
    vision: VisionInputs
    positions: Any


def image_batch(
    config: ModelConfig, tokens: np.ndarray, segments: np.ndarray, images: Sequence[ProcessedImage]
) -> ImageBatch:
    """The ImageBatch of laid-out `tokens` / `segments` [B, T] whose placeholders are those of `images`, in order.
    ValueError when the placeholders and the images disagree (datum_checks refuses such a datum first)."""
    # Qwen3-VL's config holds the same tower settings and placeholder token, and its rope index is this one
    # (transformers' two get_rope_index give an image the same positions): both families' batches are built here.
    vision, token = getattr(config, "vision", None), image_token_id(config)
    if not isinstance(vision, VisionConfig) or token is None:
        raise ValueError(f"{config.arch}: this checkpoint has no vision tower, so it takes no images")
    grids = [image.grid for image in images]
    positions, _ = rope_index(
        tokens,
        grids,
        image_token_id=token,
        merge_size=vision.spatial_merge_size,
        segment_ids=segments,
    )
    count = sum(len(image.patches) for image in images)
    length = image_patch_len(count, vision.merge_unit)
    patches = np.zeros((length, vision.patch_dim), np.float32)
    if images:
        patches[:count] = np.concatenate([image.patches for image in images])
    return ImageBatch(
        patches=patches,
        vision=vision_inputs(grids, vision, length),
        positions=np.ascontiguousarray(np.moveaxis(positions, 0, -1)),
    )
