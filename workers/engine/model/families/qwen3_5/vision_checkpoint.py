"""The vision tower's checkpoint names (`model.visual.*` in Qwen3.5's and Qwen3-VL's composite checkpoints) against
its NNX state paths, in the loader's `CheckpointNames` protocol, so the family's names can hand `model.visual.*`
tensors to it when the causal LM holds the tower under `visual`.

The module tree mirrors the checkpoint's (vision.py), so a name maps by its dots: a linear's `weight` [out, in] is
its `kernel` [in, out] (transposed), a LayerNorm's and the position table's tensors keep their names and shapes.
One tensor is reshaped, so it is gathered rather than mapped: the patch embedding's Conv3d weight
[hidden, C, T, P, P] flattened to [hidden, C * T * P * P] and transposed into `patch_embed.proj.kernel`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from .. import StatePath

PREFIX = "model.visual."
_CONV = "patch_embed.proj.weight"


class VisionNames:
    """`CheckpointNames` for the tower's tensors only (others answer None / False): names under `prefix`, state
    paths under `root`."""

    def __init__(self, root: StatePath = ("visual",), prefix: str = PREFIX):
        self.root, self.prefix = root, prefix
        self._conv: np.ndarray | None = None

    def state_path(self, name: str) -> tuple[StatePath, bool] | None:
        if not name.startswith(self.prefix) or name == self.prefix + _CONV:
            return None
        parts = tuple(int(p) if p.isdigit() else p for p in name[len(self.prefix) :].split("."))
        *module, leaf = parts
        linear = leaf == "weight" and not any("norm" in str(p) for p in module) and module != ["pos_embed"]
        return (*self.root, *module, "kernel" if linear else leaf), linear

    def gather(self, name: str, read: Callable[[], np.ndarray]) -> bool:
        if name != self.prefix + _CONV:
            return False
        weight = np.asarray(read())
        self._conv = weight.reshape(weight.shape[0], -1).T
        return True

    def gathered(self) -> Iterator[tuple[StatePath, np.ndarray]]:
        if self._conv is None:
            raise ValueError(f"checkpoint lacks {self.prefix + _CONV}")
        yield (*self.root, "patch_embed", "proj", "kernel"), self._conv
