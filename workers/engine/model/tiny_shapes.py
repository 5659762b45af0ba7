"""The tiny models' shapes: the dense shape every family's tiny checkpoint starts from, the config.json keys every
decoder family writes, and the tensor shapes of the parts they share. Below tiny_model.py (which writes the
checkpoints) and the families' tiny.py modules (which name their own tensors), so both can read it.
"""

from __future__ import annotations

from typing import Any

from .tiny_tokenizer import VOCAB_SIZE

#: Every family's tiny shape (a family's tiny.py adds its own fields, e.g. experts). vocab_size counts the special
#: tokens; the BPE is trained to vocab_size - len(SPECIAL_TOKENS).
SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 384,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "tie_word_embeddings": True,
}


def decoder_config_dict(eos_token_id: int) -> dict[str, Any]:
    """The config.json keys transformers 5 writes for every decoder family here, with SHAPE's values (plus top-level
    rope_theta/torch_dtype, as transformers 4 and published checkpoints write them, so readers of either layout find
    them); a family's tiny.py adds its architecture and its own keys."""
    import transformers

    s = SHAPE
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": eos_token_id,
        "dtype": "float32",
        "eos_token_id": eos_token_id,
        "head_dim": s["head_dim"],
        "hidden_act": "silu",
        "hidden_size": s["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": s["intermediate_size"],
        "max_position_embeddings": s["max_position_embeddings"],
        "num_attention_heads": s["num_attention_heads"],
        "num_hidden_layers": s["num_hidden_layers"],
        "num_key_value_heads": s["num_key_value_heads"],
        "pad_token_id": None,
        "rms_norm_eps": s["rms_norm_eps"],
        "rope_parameters": {"rope_theta": s["rope_theta"], "rope_type": "default"},
        "rope_theta": s["rope_theta"],
        "tie_word_embeddings": s["tie_word_embeddings"],
        "torch_dtype": "float32",
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "vocab_size": s["vocab_size"],
    }


def attention_shapes(p: str, h: int, q: int, kv: int, hd: int) -> list[tuple[str, tuple[int, ...]]]:
    """A decoder layer's norms and attention projections with q/k norms (prefix `p`), in draw order."""
    return [
        (f"{p}.input_layernorm.weight", (h,)),
        (f"{p}.self_attn.q_proj.weight", (q, h)),
        (f"{p}.self_attn.k_proj.weight", (kv, h)),
        (f"{p}.self_attn.v_proj.weight", (kv, h)),
        (f"{p}.self_attn.o_proj.weight", (h, q)),
        (f"{p}.self_attn.q_norm.weight", (hd,)),
        (f"{p}.self_attn.k_norm.weight", (hd,)),
        (f"{p}.post_attention_layernorm.weight", (h,)),
    ]


def dense_mlp_shapes(p: str, h: int, inter: int) -> list[tuple[str, tuple[int, ...]]]:
    """A dense SwiGLU MLP's projections (prefix `p`, e.g. `model.layers.0.mlp`), in draw order."""
    return [
        (f"{p}.gate_proj.weight", (inter, h)),
        (f"{p}.up_proj.weight", (inter, h)),
        (f"{p}.down_proj.weight", (h, inter)),
    ]


def embedding_shapes() -> list[tuple[str, tuple[int, ...]]]:
    return [("model.embed_tokens.weight", (SHAPE["vocab_size"], SHAPE["hidden_size"]))]


def head_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """The final norm and (untied) lm_head, drawn last."""
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.norm.weight", (SHAPE["hidden_size"],))]
    if not SHAPE["tie_word_embeddings"]:
        shapes.append(("lm_head.weight", (SHAPE["vocab_size"], SHAPE["hidden_size"])))
    return shapes
