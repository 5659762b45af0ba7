"""The MoE benchmark shape: Qwen3-30B-A3B's layer (hidden 2048, 32 q / 4 kv heads of 128, 128 experts of
intermediate 768, top-8 with norm_topk_prob, vocab 151936) with 1 layer instead of 48, so that it fits (2.4 GB of
float32 experts per layer) and runs on a shared CPU box. Random weights (std 0.02) in the published layout
(`mlp.gate.weight`, `mlp.experts.{e}.up_proj.weight`, ...),
one safetensors file per layer plus an index, as benchmarks.train writes the dense shapes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

QWEN3_30B_A3B_1L = dict(
    hidden_size=2048,
    num_hidden_layers=1,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    vocab_size=151936,
    tie_word_embeddings=False,
)


def checkpoint_config(shape: dict, dtype: str) -> dict:
    """config.json of a Qwen3 (or, when `shape` has `num_experts`, Qwen3-MoE) checkpoint of `shape`."""
    moe = bool(shape.get("num_experts"))
    return {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "torch_dtype": dtype,
        "bos_token_id": 0,
        "eos_token_id": 0,
        **shape,
    }


def matmul_params(shape: dict) -> int:
    """Active base matmul parameters per token (attention, the router and top-k experts' linears or the dense MLP,
    the unembedding), as the model's family counts them for the worker's MFU."""
    from tinkerflow.activities.accelerator_metrics import params_per_token
    from tinkerflow.workers.engine.model.families import ModelConfig

    return params_per_token(ModelConfig.from_hf(checkpoint_config(shape, "float32")))


def write_random_checkpoint(out: Path, shape: dict, dtype: str, tokenizer_from: Path) -> Path:
    """A checkpoint of `shape` (checkpoint_config) with random weights (std 0.02) in the published layout: one
    safetensors file per layer plus an index. benchmarks.train and benchmarks.sample_moe use it."""
    from safetensors.numpy import save_file

    moe = bool(shape.get("num_experts"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(checkpoint_config(shape, dtype), indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    np_dtype = np.float32 if dtype == "float32" else __import__("ml_dtypes").bfloat16
    rng = np.random.default_rng(0)
    h, v = shape["hidden_size"], shape["vocab_size"]
    q, kv, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]

    def normal(*dims):
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np_dtype)

    def ones(n):
        return np.ones(n, np_dtype)

    def mlp(prefix: str, inter: int) -> dict:
        return {
            prefix + "gate_proj.weight": normal(inter, h),
            prefix + "up_proj.weight": normal(inter, h),
            prefix + "down_proj.weight": normal(h, inter),
        }

    weight_map = {}

    def save(tensors: dict, filename: str):
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        weight_map.update({k: filename for k in tensors})

    top = {"model.embed_tokens.weight": normal(v, h), "model.norm.weight": ones(h)}
    if not shape["tie_word_embeddings"]:
        top["lm_head.weight"] = normal(v, h)
    save(top, "model-embed.safetensors")
    del top
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors = {
            p + "self_attn.q_proj.weight": normal(q * hd, h),
            p + "self_attn.k_proj.weight": normal(kv * hd, h),
            p + "self_attn.v_proj.weight": normal(kv * hd, h),
            p + "self_attn.o_proj.weight": normal(h, q * hd),
            p + "self_attn.q_norm.weight": ones(hd),
            p + "self_attn.k_norm.weight": ones(hd),
            p + "input_layernorm.weight": ones(h),
            p + "post_attention_layernorm.weight": ones(h),
        }
        if moe:
            tensors[p + "mlp.gate.weight"] = normal(shape["num_experts"], h)
            for x in range(shape["num_experts"]):
                tensors.update(mlp(p + f"mlp.experts.{x}.", shape["moe_intermediate_size"]))
        else:
            tensors.update(mlp(p + "mlp.", shape["intermediate_size"]))
        save(tensors, f"model-layer{layer:03d}.safetensors")
        del tensors
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out
