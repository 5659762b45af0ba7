"""Tiny Qwen3-MoE checkpoints in the Hugging Face layout for the MoE tests (config by transformers' Qwen3MoeConfig).

Weights as conftest.build_model draws them (std 0.25, norms near one); experts written one tensor per expert and
projection as published Qwen3-MoE checkpoints are, or (`fused=True`) as transformers 5 holds them in memory
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from conftest import build_tokenizer

H, INTER, MOE_INTER, HEADS, KV, HD, LAYERS, EXPERTS, TOP_K = 64, 128, 32, 4, 2, 16, 3, 8, 2


def moe_layers(mlp_only: list[int], step: int, layers: int = LAYERS) -> list[int]:
    return [i for i in range(layers) if i not in mlp_only and (i + 1) % step == 0]


def build_moe_model(
    directory: Path,
    *,
    seed: int = 0,
    norm_topk_prob: bool = True,
    mlp_only_layers: tuple[int, ...] = (1,),
    decoder_sparse_step: int = 1,
    fused: bool = False,
    tie: bool = False,
    layers: int = LAYERS,
    moe_inter: int = MOE_INTER,
) -> Path:
    from safetensors.numpy import save_file
    from transformers import Qwen3MoeConfig

    directory.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(directory)
    config = Qwen3MoeConfig(
        vocab_size=vocab,
        hidden_size=H,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HD,  # pyright: ignore[reportCallIssue]  (transformers 5 types the config fields it declares; head_dim is taken as a kwarg and set)
        intermediate_size=INTER,
        moe_intermediate_size=moe_inter,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(mlp_only_layers),
        decoder_sparse_step=decoder_sparse_step,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        eos_token_id=0,
        architectures=["Qwen3MoeForCausalLM"],
    )
    config.save_pretrained(directory)

    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.normal(0.0, 0.25, size=shape).astype(np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": normal(vocab, H), "model.norm.weight": 1.0 + normal(H) * 0.4}
    if not tie:
        tensors["lm_head.weight"] = normal(vocab, H)
    sparse = moe_layers(list(mlp_only_layers), decoder_sparse_step, layers)
    for i in range(layers):
        pre = f"model.layers.{i}."
        tensors.update(
            {
                pre + "self_attn.q_proj.weight": normal(HEADS * HD, H),
                pre + "self_attn.k_proj.weight": normal(KV * HD, H),
                pre + "self_attn.v_proj.weight": normal(KV * HD, H),
                pre + "self_attn.o_proj.weight": normal(H, HEADS * HD),
                pre + "self_attn.q_norm.weight": 1.0 + normal(HD) * 0.4,
                pre + "self_attn.k_norm.weight": 1.0 + normal(HD) * 0.4,
                pre + "input_layernorm.weight": 1.0 + normal(H) * 0.4,
                pre + "post_attention_layernorm.weight": 1.0 + normal(H) * 0.4,
            }
        )
        if i not in sparse:
            tensors.update(
                {
                    pre + "mlp.gate_proj.weight": normal(INTER, H),
                    pre + "mlp.up_proj.weight": normal(INTER, H),
                    pre + "mlp.down_proj.weight": normal(H, INTER),
                }
            )
            continue
        tensors[pre + "mlp.gate.weight"] = normal(EXPERTS, H)
        gate, up, down = normal(EXPERTS, moe_inter, H), normal(EXPERTS, moe_inter, H), normal(EXPERTS, H, moe_inter)
        if fused:
            tensors[pre + "mlp.experts.gate_up_proj"] = np.concatenate([gate, up], axis=1)
            tensors[pre + "mlp.experts.down_proj"] = down
        else:
            for e in range(EXPERTS):
                tensors[pre + f"mlp.experts.{e}.gate_proj.weight"] = gate[e]
                tensors[pre + f"mlp.experts.{e}.up_proj.weight"] = up[e]
                tensors[pre + f"mlp.experts.{e}.down_proj.weight"] = down[e]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
