"""The tiny Qwen3-MoE: model/tiny_model.py's shape and tokenizer (std-0.25 weights) with routed experts, written as
published Qwen3-MoE checkpoints are (`mlp.gate.weight`, `mlp.experts.{e}.gate_proj.weight`, ...).

Three layers so that both kinds of MLP are exercised: layers 0 and 2 route each token to 2 of 8 experts
(norm_topk_prob on, as Qwen3-30B-A3B), layer 1 is a dense MLP (`mlp_only_layers=[1]`). Router weights are drawn
like the rest (std 0.25): with hidden 128 the router logits then have std ~3, so routing is decisive but every
expert is used. Built by `make_tiny_model(out_dir, family="qwen3_moe")` (`tinkerflow make-tiny-model --family
qwen3_moe DIR`), which draws its weights in the order of `moe_parameter_shapes`.
"""

from __future__ import annotations

from typing import Any

from ...tiny_shapes import SHAPE, attention_shapes, decoder_config_dict, dense_mlp_shapes, embedding_shapes, head_shapes
from .. import TinyCheckpoint

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
        i
        for i in range(s["num_hidden_layers"])
        if i not in s["mlp_only_layers"] and (i + 1) % s["decoder_sparse_step"] == 0
    ]


def moe_config_dict(dense: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers writes it for Qwen3MoeForCausalLM, from a dense decoder's."""
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
        "sliding_window": None,
        "use_sliding_window": False,
    }


def moe_parameter_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """HF parameter names and shapes of the tiny Qwen3-MoE, in the (fixed) order the weights are drawn."""
    s, m = SHAPE, MOE_SHAPE
    h, hd = s["hidden_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    sparse = set(moe_layers())
    shapes = embedding_shapes()
    for i in range(m["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += attention_shapes(p, h, q, kv, hd)
        if i in sparse:
            inter = m["moe_intermediate_size"]
            shapes.append((f"{p}.mlp.gate.weight", (m["num_experts"], h)))
            for e in range(m["num_experts"]):
                shapes += dense_mlp_shapes(f"{p}.mlp.experts.{e}", h, inter)
        else:
            shapes += dense_mlp_shapes(f"{p}.mlp", h, m["intermediate_size"])
    return shapes + head_shapes()


TINY = TinyCheckpoint(
    config=lambda eos_token_id: moe_config_dict(decoder_config_dict(eos_token_id)),
    parameter_shapes=moe_parameter_shapes,
    marker={"moe": MOE_SHAPE},  # as tinkerflow_tiny.json has said since the tiny MoE was first written
)
