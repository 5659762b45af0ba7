"""The tiny Qwen3-MoE: the tiny Qwen3 of tiny_model.py (same tokenizer, attention, std-0.25 weights) with routed
experts, written as published Qwen3-MoE checkpoints are (`mlp.gate.weight`, `mlp.experts.{e}.gate_proj.weight`, ...).

Three layers so that both kinds of MLP are exercised: layers 0 and 2 route each token to 2 of 8 experts
(norm_topk_prob on, as Qwen3-30B-A3B), layer 1 is a dense MLP (`mlp_only_layers=[1]`). Router weights are drawn
like the rest (std 0.25): with hidden 128 the router logits then have std ~3, so routing is decisive but every
expert is used. Built by `make_tiny_model(out_dir, moe=True)` (`tinkerflow make-tiny-model --moe DIR`), which
draws its weights in the order of `tiny_model.moe_parameter_shapes`.
"""

from __future__ import annotations

from typing import Any

MOE_SHAPE: dict[str, Any] = {
    "num_hidden_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "intermediate_size": 256,  # the dense layer's
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "norm_topk_prob": True,
}


def moe_layers() -> list[int]:
    s = MOE_SHAPE
    return [
        i for i in range(s["num_hidden_layers"])
        if i not in s["mlp_only_layers"] and (i + 1) % s["decoder_sparse_step"] == 0
    ]  # fmt: skip


def moe_config_dict(dense: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers writes it for Qwen3MoeForCausalLM, from the dense tiny model's."""
    s = MOE_SHAPE
    layers = s["num_hidden_layers"]
    return {
        **dense,
        **s,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "layer_types": ["full_attention"] * layers,
        "max_window_layers": layers,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }
