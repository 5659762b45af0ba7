"""The vision tower's settings (transformers' `Qwen3_5VisionConfig`, `Qwen3VLVisionConfig`: a composite config's
`vision_config`) and what the tower needs to know about each patch, computed on the host from the images' grids.

Everything here that depends on the images' sizes is numpy, so the jitted tower (vision.py) sees only arrays of a
fixed length: a call's patches are padded to a bucketed length, and the padding is segment 0.

`VisionInputs`, per patch, in the order the image processor emits them (merge_size x merge_size blocks, row by row;
tinkerflow.common.images):

* `segments`: 1 + the image's index (0: padding). The tower's attention is bidirectional within one image
  (transformers' cu_seqlens; a still image is one frame, and each frame of a video is its own segment there too);
* `positions`: the patch's (row, column) in its image's grid, the 2-D rotary positions;
* `interp_index` / `interp_weight`: the four taps and bilinear weights (align_corners) that resample the learned
  square position-embedding table to the image's grid (transformers' `get_vision_interpolation_indices_and_weights`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from tinkerflow.common.images import ImageProcessing

_ACTIVATIONS = {"gelu_pytorch_tanh": True, "gelu": False}  # hidden_act -> tanh approximation


@dataclass(frozen=True, slots=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    layer_norm_eps: float = 1e-6
    # Qwen3-VL's DeepStack: the blocks after which a merger of its own turns the patches into extra features
    # for the language model's first layers (empty for Qwen3.5)
    deepstack_visual_indexes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act {self.hidden_act!r} is not supported (one of {sorted(_ACTIVATIONS)})")
        if self.hidden_size % self.num_heads or self.head_dim % 4:
            raise ValueError(
                f"vision hidden_size={self.hidden_size} / num_heads={self.num_heads} must be a multiple of 4 "
                "(the 2-D rope splits each head into row and column halves of cos/sin pairs)"
            )
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(f"num_position_embeddings={self.num_position_embeddings} must be a square")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"deepstack_visual_indexes {bad} outside the {self.depth} vision blocks")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch row (the image processor's): channels x temporal_patch_size x patch_size**2."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        """Patches per output token: spatial_merge_size**2."""
        return self.spatial_merge_size**2

    @property
    def grid_side(self) -> int:
        """The learned position table's side (it holds grid_side**2 rows)."""
        return math.isqrt(self.num_position_embeddings)

    @property
    def tanh_gelu(self) -> bool:
        return _ACTIVATIONS[self.hidden_act]

    def inv_freq(self) -> np.ndarray:
        """The axial rope's inverse frequencies [head_dim // 4], shared by rows and columns."""
        dim = self.head_dim // 2
        return (1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))).astype(np.float32)

    def check_processing(self, processing: ImageProcessing) -> None:
        """ValueError unless the image processor cuts the patches this tower reads (a checkpoint's
        preprocessor_config.json against its config.json)."""
        ours = (self.patch_size, self.temporal_patch_size, self.spatial_merge_size)
        theirs = (processing.patch_size, processing.temporal_patch_size, processing.merge_size)
        if ours != theirs:
            raise ValueError(
                f"the image processor's (patch_size, temporal_patch_size, merge_size) {theirs} differ from the "
                f"vision tower's {ours}"
            )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> VisionConfig:
        """From a composite config.json (its `vision_config`) or a vision config itself."""
        vision = hf.get("vision_config") or hf
        rope = dict(vision.get("rope_parameters") or {})
        if rope.get("rope_type", "axial") not in ("axial", "default"):
            raise ValueError(f"vision rope type {rope['rope_type']!r} is not supported (only axial)")
        return cls(
            depth=int(vision["depth"]),
            hidden_size=int(vision["hidden_size"]),
            intermediate_size=int(vision["intermediate_size"]),
            num_heads=int(vision["num_heads"]),
            patch_size=int(vision["patch_size"]),
            temporal_patch_size=int(vision["temporal_patch_size"]),
            spatial_merge_size=int(vision["spatial_merge_size"]),
            out_hidden_size=int(vision["out_hidden_size"]),
            num_position_embeddings=int(vision["num_position_embeddings"]),
            in_channels=int(vision.get("in_channels", 3)),
            hidden_act=str(vision.get("hidden_act", "gelu_pytorch_tanh")),
            rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", 10000.0))),
            deepstack_visual_indexes=tuple(int(i) for i in vision.get("deepstack_visual_indexes") or ()),
        )


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["segments", "positions", "interp_index", "interp_weight"],
    meta_fields=[],
)
@dataclass(frozen=True)
class VisionInputs:
    """Per patch (module docstring): `segments` int32 [N], `positions` int32 [N, 2], `interp_index` int32 [N, 4],
    `interp_weight` float32 [N, 4]; N the padded patch count."""

    segments: Any
    positions: Any
    interp_index: Any
    interp_weight: Any


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor + 1, clamped to the table) and weights along one axis, align_corners: index 0
    maps to 0 and size - 1 to side - 1 (float32 arithmetic, as transformers computes it)."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(src)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)), 0, None)
    return taps, weights.astype(np.float32)


def vision_inputs(
    grids: Sequence[tuple[int, int, int]], config: VisionConfig, length: int | None = None
) -> VisionInputs:
    """The per-patch inputs for images of patch grids `grids` (temporal, height, width), their patches side by
    side in the processor's order, padded to `length` patches (None: no padding). ValueError when a grid is not
    whole merge blocks or the patches overflow `length`."""
    m, side = config.spatial_merge_size, config.grid_side
    segments, rows, cols = [], [], []
    for i, (t, h, w) in enumerate(grids):
        if t < 1 or h < m or w < m or h % m or w % m:
            raise ValueError(f"image grid {(t, h, w)} must be at least 1 frame of whole {m}x{m} patch blocks")
        # patch k of a frame: block (k // m**2) in row-major order of blocks, then (row, col) within the block
        k = np.arange(h * w)
        block, within = k // (m * m), k % (m * m)
        row = (block // (w // m)) * m + within // m
        col = (block % (w // m)) * m + within % m
        segments.append(np.full(t * h * w, i + 1, np.int32))
        rows.append(np.tile(row, t))
        cols.append(np.tile(col, t))
    heights = np.concatenate([np.full(t * h * w, h) for t, h, w in grids]) if grids else np.zeros(0, np.int64)
    widths = np.concatenate([np.full(t * h * w, w) for t, h, w in grids]) if grids else np.zeros(0, np.int64)
    row = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    col = np.concatenate(cols) if cols else np.zeros(0, np.int64)
    h_taps, h_weights = _axis_taps(row, heights, side)
    w_taps, w_weights = _axis_taps(col, widths, side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    n = len(row)
    length = n if length is None else length
    if n > length or length % config.merge_unit:
        raise ValueError(f"{n} patches do not fit length={length} (a multiple of {config.merge_unit} at least that)")
    pad = length - n
    return VisionInputs(
        segments=np.pad(np.concatenate(segments) if segments else np.zeros(0, np.int32), (0, pad)).astype(np.int32),
        positions=np.pad(np.stack([row, col], axis=-1), ((0, pad), (0, 0))).astype(np.int32),
        interp_index=np.pad(index, ((0, pad), (0, 0))).astype(np.int32),
        interp_weight=np.pad(weight, ((0, pad), (0, 0))).astype(np.float32),
    )
