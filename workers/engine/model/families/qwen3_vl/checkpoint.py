"""Qwen3-VL's checkpoint names: the ForConditionalGeneration layout, its text model under `model.language_model.*`
(`lm_head` on top) and the tower under `model.visual.*`.

A text tensor is named as the causal LM's checkpoint names it (`model.language_model.x` -> `model.x`, as Qwen3.5's
composite names are read) and placed by the names Qwen3 and Qwen3-MoE share (loader.DecoderNames, qwen3_moe's
ExpertNames for experts, per expert or fused); the tower's tensors by vision_checkpoint.VisionNames.

Qwen3-VL-MoE's published checkpoints keep the fused experts transposed from transformers 5's layout:
`mlp.experts.gate_up_proj` [E, H, 2I] and `mlp.experts.down_proj` [E, I, H], where transformers 5 holds [E, 2I, H]
and [E, H, I]. As transformers' loader does (its Transpose with check_dims), a fused tensor whose shape is not the
expected one is read with its last two axes swapped.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np

from .. import ModelConfig, StatePath
from ..qwen3_5.checkpoint import text_name
from ..qwen3_5.vision_checkpoint import VisionNames
from ..qwen3_moe.checkpoint import ExpertNames

_FUSED = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


class Qwen3VLNames(ExpertNames):
    """Qwen3-VL's `CheckpointNames` (module doc); a dense model simply has no expert tensors."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.vision = VisionNames()

    def state_path(self, name: str) -> tuple[StatePath, bool] | None:
        found = self.vision.state_path(name)
        return found if found is not None else super().state_path(text_name(name))

    def gather(self, name: str, read: Callable[[], np.ndarray]) -> bool:
        if self.vision.gather(name, read):
            return True
        name = text_name(name)
        m = _FUSED.match(name)
        if m is None:
            return super().gather(name, read)
        return super().gather(name, lambda: self._transformers_layout(m.group(1), np.asarray(read())))

    def _transformers_layout(self, proj: str, tensor: np.ndarray) -> np.ndarray:
        c = self.config
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        want = (e, 2 * i, h) if proj == "gate_up_proj" else (e, h, i)
        return tensor if tensor.shape == want else tensor.transpose(0, 2, 1)

    def gathered(self) -> Iterator[tuple[StatePath, np.ndarray]]:
        yield from super().gathered()
        yield from self.vision.gathered()
