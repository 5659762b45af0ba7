"""The tiny Qwen3 (model/tiny_model.py writes it): config.json as transformers 5 writes it for Qwen3ForCausalLM, and
its tensor names in the order the weights are drawn."""

from __future__ import annotations

from typing import Any

from ...tiny_shapes import SHAPE, attention_shapes, decoder_config_dict, dense_mlp_shapes, embedding_shapes, head_shapes
from .. import TinyCheckpoint


def config_dict(eos_token_id: int) -> dict[str, Any]:
    layers = SHAPE["num_hidden_layers"]
    return {
        **decoder_config_dict(eos_token_id),
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "layer_types": ["full_attention"] * layers,
        "max_window_layers": layers,
        "sliding_window": None,
        "use_sliding_window": False,
    }


def parameter_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """HF parameter names and shapes of the tiny Qwen3, in the (fixed) order the weights are drawn."""
    s = SHAPE
    h, hd, inter = s["hidden_size"], s["head_dim"], s["intermediate_size"]
    q, kv = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    shapes = embedding_shapes()
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes += attention_shapes(p, h, q, kv, hd) + dense_mlp_shapes(f"{p}.mlp", h, inter)
    return shapes + head_shapes()


TINY = TinyCheckpoint(config=config_dict, parameter_shapes=parameter_shapes)
