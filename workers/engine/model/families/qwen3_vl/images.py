"""A Qwen3-VL training batch's images as its causal LM reads them (`Family.image_batch`): the batch's images as one
padded run of patch rows for the tower and every token's 3-D rotary positions, in qwen3_5/vision_batch.py's
`ImageBatch` (its module doc says how packing, bucketing and placeholder order work; they are the same here).

Qwen3-VL's rope index is Qwen3.5's (transformers' two get_rope_index give an image the same positions), so this is
vision_batch.image_batch for a config that is not a Qwen35Config: the tower's settings and the placeholder token
are read from Qwen3VLConfig instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tinkerflow.common.images import ProcessedImage

from ....shape_buckets import image_patch_len
from .. import ModelConfig
from ..qwen3_5.vision_batch import ImageBatch
from ..qwen3_5.vision_config import vision_inputs
from ..qwen3_5.vision_merge import rope_index
from .config import Qwen3VLConfig


def image_batch(
    config: ModelConfig, tokens: np.ndarray, segments: np.ndarray, images: Sequence[ProcessedImage]
) -> ImageBatch:
    """The ImageBatch of laid-out `tokens` / `segments` [B, T] whose placeholders are those of `images`, in order.
    ValueError when the placeholders and the images disagree (datum_checks refuses such a datum first)."""
    if not isinstance(config, Qwen3VLConfig) or config.vision is None or config.image_token_id is None:
        raise ValueError(f"{config.arch}: this checkpoint has no vision tower, so it takes no images")
    vision = config.vision
    grids = [image.grid for image in images]
    positions, _ = rope_index(
        tokens, grids, image_token_id=config.image_token_id, merge_size=vision.spatial_merge_size, segment_ids=segments
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
