"""Model configuration read from a Hugging Face `config.json`, plus the shape buckets the jitted steps compile for.

One frozen dataclass covers every supported family; the differences between Qwen3 and Llama 3 are flags
(`qk_norm`) and the rope variant, so adding a dense family is a new entry in `_FAMILIES` rather than a new model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

# model_type in config.json -> (our arch name, per-head q/k RMSNorm)
_FAMILIES: dict[str, tuple[str, bool]] = {
    "qwen3": ("qwen3", True),
    "llama": ("llama", False),
    "qwen3_moe": ("qwen3_moe", True),  # Qwen3 attention + routed experts (moe.py)
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    # Llama 3 style rope scaling ("llama3"), or None for plain rope.
    rope_scaling: tuple[tuple[str, float], ...] | None = None
    # Mixture of experts (Qwen3-MoE); num_experts == 0 for dense models. `moe_layers` lists the decoder layers whose
    # MLP is the routed-expert block (decoder_sparse_step / mlp_only_layers resolved at parse time).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} must be divisible by num_key_value_heads={self.num_kv_heads}"
            )

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed config.json; raises ValueError for anything this engine cannot run exactly."""
        model_type = hf.get("model_type")
        if model_type not in _FAMILIES:
            archs = hf.get("architectures") or []
            raise ValueError(
                f"unsupported architecture {model_type!r} ({', '.join(archs) or 'no architectures listed'}); "
                f"supported model_type: {', '.join(sorted(_FAMILIES))}"
            )
        arch, qk_norm = _FAMILIES[model_type]
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError(f"{model_type} with attention_bias/mlp_bias is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf.get('hidden_act')!r} is not supported (only silu)")
        if hf.get("quantization_config"):  # e.g. Qwen3-30B-A3B-FP8: weights need their scales, which we do not apply
            method = (hf["quantization_config"] or {}).get("quant_method", "?")
            raise ValueError(f"quantized checkpoints ({method}) are not supported; use the bf16/fp32 release")
        if hf.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        # transformers 5 moved rope settings under rope_parameters; older files keep rope_theta/rope_scaling on top.
        rope = dict(hf.get("rope_parameters") or {})
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = rope if rope.get("rope_type", "default") != "default" else (hf.get("rope_scaling") or None)
        rope_scaling = None
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "default":
                rope_scaling = None
            elif kind == "llama3":
                keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                rope_scaling = tuple((k, float(scaling[k])) for k in keys)
            else:
                raise ValueError(f"rope scaling type {kind!r} is not supported (only llama3)")
        num_heads = hf["num_attention_heads"]
        moe = _moe_fields(hf) if arch == "qwen3_moe" else {}
        return cls(
            arch=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=qk_norm,
            rope_scaling=rope_scaling,
            **moe,
        )

    def is_moe_layer(self, index: int) -> bool:
        return index in self.moe_layers

    def inv_freq(self) -> np.ndarray:
        """Rope inverse frequencies [head_dim // 2], with llama3 scaling applied as transformers does."""
        inv = 1.0 / (self.rope_theta ** (np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim))
        if self.rope_scaling is None:
            return inv.astype(np.float32)
        s = dict(self.rope_scaling)
        factor, low, high, old_ctx = (
            s["factor"],
            s["low_freq_factor"],
            s["high_freq_factor"],
            s["original_max_position_embeddings"],
        )
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)


def _moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3MoeConfig's expert settings, with transformers' rule for which layers are sparse:
    layer i is MoE iff i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0."""
    # transformers 5 writes num_experts as num_local_experts (its attribute_map); published files say num_experts.
    experts = int(hf.get("num_experts", hf.get("num_local_experts", 0)) or 0)
    top_k = int(hf.get("num_experts_per_tok", 0) or 0)
    step, dense_only = int(hf.get("decoder_sparse_step", 1) or 1), set(hf.get("mlp_only_layers") or [])
    if experts > 0 and not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={experts}]")
    layers = tuple(
        i for i in range(hf["num_hidden_layers"]) if i not in dense_only and experts > 0 and (i + 1) % step == 0
    )
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 0) or 0),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=layers,
    )
