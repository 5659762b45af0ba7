"""Qwen3.5's checkpoint names, in both layouts transformers 5.23 saves: `*ForCausalLM` (`model.layers.*`,
`model.embed_tokens`, `model.norm`, `lm_head`) and `*ForConditionalGeneration` (the same under
`model.language_model.*`, with the vision tower `model.visual.*` beside it). Published Qwen3.5 checkpoints also carry
`mtp.*`, the multi-token-prediction layers. A composite checkpoint's tower is loaded beside the text model (under
`visual`, by vision_checkpoint.py's names) when its config.json has a `vision_config`; the MTP layers are not built
(MTP only drafts tokens for speculative decoding), so their tensors are skipped, with one INFO line saying so.

Our module tree mirrors transformers' (model.py), so a layer tensor `model.layers.3.linear_attn.in_proj_qkv.weight`
[out, in] is the state leaf `layers.3.linear_attn.in_proj_qkv.kernel` [in, out]; norms, `A_log` and `dt_bias` keep
their names and shapes; the depthwise conv's weight [C, 1, K] is squeezed to [C, K]. The routed experts, per expert
or fused as transformers 5 saves them, are stacked as Qwen3-MoE's are (the same model/moe.py block).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator

import numpy as np

from .. import ModelConfig, StatePath
from ..qwen3_moe.checkpoint import ExpertNames
from .config import Qwen35Config
from .vision_checkpoint import PREFIX as VISION_PREFIX
from .vision_checkpoint import VisionNames

log = logging.getLogger(__name__)

_TEXT_PREFIXES = ("model.language_model.", "model.")
_NOT_BUILT = {"model.visual.": "the vision tower", "mtp.": "the multi-token-prediction (MTP) layers"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|A_log|dt_bias)$")
_NO_TRANSPOSE = ("A_log", "dt_bias")


def text_name(name: str) -> str:
    """A tensor's name as the causal LM's checkpoint has it (`model.language_model.x` -> `model.x`)."""
    prefix = _TEXT_PREFIXES[0]
    return "model." + name[len(prefix) :] if name.startswith(prefix) else name


class Qwen35Names(ExpertNames):
    """Qwen3.5's `CheckpointNames` (see the module doc); the experts' stacking is ExpertNames'."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.convs: dict[StatePath, np.ndarray] = {}
        self.skipped: dict[str, int] = {}
        has_tower = isinstance(config, Qwen35Config) and config.vision is not None
        self.vision = VisionNames() if has_tower else None

    def state_path(self, name: str) -> tuple[StatePath, bool] | None:
        if self.vision is not None and name.startswith(VISION_PREFIX):
            return self.vision.state_path(name)
        part = next((p for p in _NOT_BUILT if name.startswith(p)), None)
        if part is not None:
            if part not in self.skipped:
                log.info(
                    "not loading %s of this checkpoint (%s*): the engine does not build them",
                    _NOT_BUILT[part],
                    part,
                )
            self.skipped[part] = self.skipped.get(part, 0) + 1
            return None
        name = text_name(name)
        m = _LAYER.match(name)
        if m is None:
            return super().state_path(name)
        layer, module, leaf = int(m.group(1)), tuple(m.group(2).split(".")), m.group(3)
        if leaf in _NO_TRANSPOSE:
            return ("layers", layer, *module, leaf), False
        if module[-1].endswith("norm"):
            return ("layers", layer, *module, "weight"), False
        return ("layers", layer, *module, "kernel"), True

    def gather(self, name: str, read: Callable[[], np.ndarray]) -> bool:
        if self.vision is not None and self.vision.gather(name, read):
            return True
        name = text_name(name)
        m = _LAYER.match(name)
        if m is not None and m.group(2).endswith("conv1d"):
            value = np.asarray(read(), np.float32)
            if value.ndim == 3:  # [C, 1, K] as torch's depthwise Conv1d keeps it
                value = value[:, 0, :]
            self.convs[("layers", int(m.group(1)), *m.group(2).split("."), "weight")] = value
            return True
        return super().gather(name, read)

    def gathered(self) -> Iterator[tuple[StatePath, np.ndarray]]:
        yield from self.convs.items()
        yield from super().gathered()
        if self.vision is not None:
            yield from self.vision.gathered()
