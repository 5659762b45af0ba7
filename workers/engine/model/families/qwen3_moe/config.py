"""Qwen3-MoE's config.json: the shared decoder fields plus Qwen3MoeConfig's expert settings."""

from __future__ import annotations

from typing import Any

from .. import ModelConfig


def read_config(hf: dict[str, Any]) -> ModelConfig:
    return ModelConfig.read(hf, arch="qwen3_moe", qk_norm=True, **moe_fields(hf))


def moe_fields(hf: dict[str, Any]) -> dict[str, Any]:
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
