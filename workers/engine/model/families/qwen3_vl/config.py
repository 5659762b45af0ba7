"""Qwen3-VL's settings: the engine's `ModelConfig` of its text model plus the vision tower, the image placeholder token
and mrope's sections, read from transformers' `Qwen3VLConfig` / `Qwen3VLMoeConfig` (a composite config.json: the text
settings under `text_config`, the tower's under `vision_config`, the vision tokens and `tie_word_embeddings` on top).

The text model is Qwen3's (q/k norm, every layer full attention) or, for `qwen3_vl_moe`, Qwen3-MoE's (its routed
experts on the layers Qwen3MoeConfig's rule picks; the router always renormalises its top-k weights, as Qwen3-VL-MoE's
has no `norm_topk_prob` switch). Its rope turns every head dim ("default" rope) with the interleaved multimodal
positions of vision_merge.py; text positions are equal on the three axes, where that is Qwen3's plain rope.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import ModelConfig
from ..qwen3_5.vision_config import VisionConfig
from ..qwen3_5.vision_merge import mrope_section
from ..qwen3_moe.config import moe_fields

_ARCH = {"qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl_moe"}
# transformers' Qwen3VLTextRotaryEmbedding's sections when the config names none
DEFAULT_MROPE_SECTION = (24, 20, 20)


@dataclass(frozen=True, slots=True)
class Qwen3VLConfig(ModelConfig):
    # The tower, the token its image features replace, and mrope's rotary frequencies per axis (temporal, height,
    # width); a Qwen3-VL checkpoint always has them (defaults only for the dataclass).
    vision: VisionConfig | None = None
    image_token_id: int | None = None
    mrope_section: tuple[int, int, int] = DEFAULT_MROPE_SECTION

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)  # (zero-argument super() does not reach a slots dataclass's parent)
        if self.vision is None or self.image_token_id is None:
            raise ValueError(f"{self.arch} needs a vision_config and an image_token_id")
        if self.vision.out_hidden_size != self.hidden_size:
            raise ValueError(
                f"vision_config.out_hidden_size={self.vision.out_hidden_size} != text hidden_size={self.hidden_size}"
            )
        if len(self.vision.deepstack_visual_indexes) > self.num_layers:
            raise ValueError(
                f"{len(self.vision.deepstack_visual_indexes)} DeepStack features for {self.num_layers} decoder layers"
            )

    @property
    def image_feature_size(self) -> int:
        """The width of what the tower gives per placeholder: its feature and each DeepStack feature side by side
        (image_inputs.tower_features)."""
        assert self.vision is not None
        return self.hidden_size * (1 + len(self.vision.deepstack_visual_indexes))

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Qwen3VLConfig:
        """From a composite config.json; ValueError names what cannot run exactly."""
        model_type = hf.get("model_type")
        if model_type not in _ARCH:
            raise ValueError(f"model_type {model_type!r} is not Qwen3-VL (one of {', '.join(sorted(_ARCH))})")
        if not hf.get("text_config") or not hf.get("vision_config"):
            raise ValueError(f"{model_type}: config.json needs text_config and vision_config")
        if hf.get("quantization_config"):
            raise ValueError("quantized checkpoints are not supported; use the bf16/fp32 release")
        text = dict(hf["text_config"])
        rope = dict(text.get("rope_parameters") or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope type {rope['rope_type']!r} is not supported (only default)")
        # the composite's own tie_word_embeddings governs (Qwen3VLConfig's attribute), the text config's is a copy
        text["tie_word_embeddings"] = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        arch = _ARCH[model_type]
        experts: dict[str, Any] = {**moe_fields(text), "norm_topk_prob": True} if arch == "qwen3_vl_moe" else {}
        config = cls.read(
            text,
            arch=arch,
            qk_norm=True,
            **experts,
            vision=VisionConfig.from_hf(hf),
            image_token_id=int(hf["image_token_id"]) if "image_token_id" in hf else None,
            mrope_section=mrope_section(hf, DEFAULT_MROPE_SECTION),
        )
        assert isinstance(config, Qwen3VLConfig)  # ModelConfig.read builds the class it is called on
        return config
