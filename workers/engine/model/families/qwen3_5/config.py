"""Qwen3.5's settings: the engine's `ModelConfig` (whose fields the shared pieces read: embedding, LM head, routed
experts, rope tables) plus what the hybrid layers add: which mixer each layer runs, the Gated DeltaNet sizes, the
partial rotary fraction and the shared expert's width.

Read from transformers' `Qwen3_5Config` / `Qwen3_5MoeConfig` (`qwen3_5`, `qwen3_5_moe`, whose text settings sit under
`text_config`) or their text configs (`qwen3_5_text`, `qwen3_5_moe_text`). A composite config's `vision_config` gives
`vision` (the tower the causal LM then holds, vision.py), with the image placeholder token and mrope's sections.
Text positions are the same on mrope's three axes, so for text mrope reduces to plain rope on the rotary dims; a
datum with images takes the 3-D positions of vision_merge.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import ModelConfig
from .vision_config import VisionConfig
from .vision_merge import mrope_section

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"
_ARCH = {
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
}


@dataclass(frozen=True, slots=True)
class Qwen35Config(ModelConfig):
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    shared_expert_intermediate_size: int = 0
    # A vision-language checkpoint's tower, the token its image features replace, and mrope's rotary frequencies per
    # axis (temporal, height, width); None / unused for a text model.
    vision: VisionConfig | None = None
    image_token_id: int | None = None
    mrope_section: tuple[int, int, int] = (11, 11, 10)

    def __post_init__(self) -> None:
        ModelConfig.__post_init__(self)  # (zero-argument super() does not reach a slots dataclass's parent)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for num_hidden_layers={self.num_layers}")
        unknown = sorted(set(self.layer_types) - {LINEAR_ATTENTION, FULL_ATTENTION})
        if unknown:
            raise ValueError(f"layer_types: unknown {unknown} (only {LINEAR_ATTENTION!r}, {FULL_ATTENTION!r})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.linear_num_value_heads} must be divisible by "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} x head_dim={self.head_dim} must give an even "
                f"rotary width in (0, head_dim]"
            )
        if self.vision is not None and self.image_token_id is None:
            raise ValueError("a config with a vision_config needs image_token_id")

    @property
    def image_feature_size(self) -> int:
        """The width of what the tower gives per placeholder (`image_inputs.tower_features`): the hidden size, as
        Qwen3.5 has no DeepStack features (Qwen3-VL's config answers more)."""
        return self.hidden_size

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each attention head that rope rotates (transformers' int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """The conv's channels: q, k and v side by side, as `in_proj_qkv` emits them."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def inv_freq(self) -> np.ndarray:
        """Rope inverse frequencies over the rotary dims only [rotary_dim // 2] (transformers' default rope)."""
        dim = self.rotary_dim
        return (1.0 / (self.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))).astype(np.float32)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> Qwen35Config:
        """From a parsed config.json (the composite or the text config); ValueError names what cannot run exactly."""
        model_type = hf.get("model_type")
        if model_type not in _ARCH:
            raise ValueError(f"model_type {model_type!r} is not Qwen3.5 (expected one of {', '.join(sorted(_ARCH))})")
        text = hf.get("text_config") or hf
        if text.get("attention_bias"):
            raise ValueError(f"{model_type} with attention_bias is not supported")
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {text.get('hidden_act')!r} is not supported (only silu)")
        if hf.get("quantization_config") or text.get("quantization_config"):
            raise ValueError("quantized checkpoints are not supported; use the bf16/fp32 release")
        rope = dict(text.get("rope_parameters") or {})
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope type {rope['rope_type']!r} is not supported (only default)")
        layers = int(text["num_hidden_layers"])
        layer_types = text.get("layer_types") or [
            FULL_ATTENTION if (i + 1) % int(text.get("full_attention_interval", 4)) == 0 else LINEAR_ATTENTION
            for i in range(layers)
        ]
        arch = _ARCH[model_type]
        experts = int(text.get("num_experts", 0) or 0) if arch == "qwen3_5_moe" else 0
        top_k = int(text.get("num_experts_per_tok", 0) or 0) if experts else 0
        if experts and not 1 <= top_k <= experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
        num_heads = int(text["num_attention_heads"])
        vision = VisionConfig.from_hf(hf) if hf.get("vision_config") else None
        if vision is not None and vision.out_hidden_size != int(text["hidden_size"]):
            raise ValueError(
                f"vision_config.out_hidden_size={vision.out_hidden_size} != text hidden_size={text['hidden_size']}"
            )
        return cls(
            arch=arch,
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            intermediate_size=int(text.get("intermediate_size", 0) or 0),
            num_layers=layers,
            num_heads=num_heads,
            num_kv_heads=int(text.get("num_key_value_heads") or num_heads),
            head_dim=int(text.get("head_dim") or text["hidden_size"] // num_heads),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            qk_norm=True,
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(text.get("moe_intermediate_size", 0) or 0) if experts else 0,
            norm_topk_prob=bool(experts),  # Qwen3.5-MoE's router always renormalises its top-k weights
            moe_layers=tuple(range(layers)) if experts else (),  # every layer's MLP is the expert block
            layer_types=tuple(layer_types),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size", 0) or 0) if experts else 0,
            vision=vision,
            image_token_id=int(hf["image_token_id"]) if vision is not None and "image_token_id" in hf else None,
            mrope_section=mrope_section(hf),
        )
