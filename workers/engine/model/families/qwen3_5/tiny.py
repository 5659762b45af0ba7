"""The tiny Qwen3.5 and Qwen3.5-MoE (model/tiny_model.py writes them): config.json as transformers 5.23 writes it for
`Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` (the text model, `qwen3_5_text` / `qwen3_5_moe_text`), their tensor
names in draw order, and a tokenizer with Qwen3.5's chat tokens so tinker-cookbook's `qwen3_5` renderer runs on it.

Sizes differ from the tiny Qwen3's (hidden 128, 2 layers) so a family mix-up cannot pass: hidden 96, 4 layers (three
Gated DeltaNet, then full attention, Qwen3.5's full_attention_interval of 4), 4 attention heads on 2 key/value heads
of dim 32 (rotary 8 of them), Gated DeltaNet 4 value heads of dim 24 on 2 key heads of dim 16. The MoE twin routes
each token to 2 of 8 experts of width 64 beside a shared expert of width 96.
"""

from __future__ import annotations

from typing import Any

from ...tiny_shapes import SHAPE, dense_mlp_shapes, embedding_shapes, head_shapes
from .. import TinyCheckpoint

QWEN35_SHAPE: dict[str, Any] = {
    "hidden_size": 96,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 24,
    "linear_conv_kernel_dim": 4,
    "intermediate_size": 256,
}
MOE_SHAPE: dict[str, Any] = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 96,
}
# Qwen3.5's chat tokens beyond ChatML's (the order of its tokenizer's added tokens, those the renderer reads).
CHAT_TOKENS = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
)
# Qwen3.5's chat format in brief (the renderer builds prompts itself; this serves apply_chat_template): ChatML turns
# whose content is a string or a list of items (an image item in its vision tokens, as the release's template renders
# it: the chat endpoints put an image there), and a generation prompt that opens the assistant's thinking.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)


def _layer_types() -> list[str]:
    s = QWEN35_SHAPE
    interval = s["full_attention_interval"]
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(s["num_hidden_layers"])]


def config_dict(eos_token_id: int, *, moe: bool) -> dict[str, Any]:
    import transformers

    s = QWEN35_SHAPE
    rope = {"rope_type": "default", "rope_theta": SHAPE["rope_theta"], "partial_rotary_factor": 0.25}
    shape = {k: v for k, v in s.items() if k != "partial_rotary_factor"}
    return {
        **shape,
        **(MOE_SHAPE if moe else {}),
        "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": eos_token_id,
        "dtype": "float32",
        "eos_token_id": eos_token_id,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "layer_types": _layer_types(),
        "max_position_embeddings": SHAPE["max_position_embeddings"],
        "pad_token_id": None,
        "rms_norm_eps": SHAPE["rms_norm_eps"],
        "rope_parameters": rope,
        "tie_word_embeddings": SHAPE["tie_word_embeddings"],
        "transformers_version": transformers.__version__,
        "use_cache": True,
        "vocab_size": SHAPE["vocab_size"],
    }


def parameter_shapes(*, moe: bool) -> list[tuple[str, tuple[int, ...]]]:
    """HF parameter names and shapes, in the (fixed) order the weights are drawn; experts fused as transformers 5.23
    saves them."""
    s, m = QWEN35_SHAPE, MOE_SHAPE
    h, hd, nh, nkv = s["hidden_size"], s["head_dim"], s["num_attention_heads"], s["num_key_value_heads"]
    nv, kd = s["linear_num_value_heads"], s["linear_num_key_heads"] * s["linear_key_head_dim"]
    vd = nv * s["linear_value_head_dim"]
    conv = 2 * kd + vd
    shapes: list[tuple[str, tuple[int, ...]]] = [(n, (SHAPE["vocab_size"], h)) for n, _ in embedding_shapes()]
    for i, kind in enumerate(_layer_types()):
        p = f"model.layers.{i}"
        shapes.append((f"{p}.input_layernorm.weight", (h,)))
        if kind == "linear_attention":
            a = f"{p}.linear_attn"
            shapes += [
                (f"{a}.in_proj_qkv.weight", (conv, h)),
                (f"{a}.in_proj_z.weight", (vd, h)),
                (f"{a}.in_proj_b.weight", (nv, h)),
                (f"{a}.in_proj_a.weight", (nv, h)),
                (f"{a}.conv1d.weight", (conv, 1, s["linear_conv_kernel_dim"])),
                (f"{a}.dt_bias", (nv,)),
                (f"{a}.A_log", (nv,)),
                (f"{a}.norm.weight", (s["linear_value_head_dim"],)),
                (f"{a}.out_proj.weight", (h, vd)),
            ]
        else:
            a = f"{p}.self_attn"
            shapes += [
                (f"{a}.q_proj.weight", (2 * nh * hd, h)),
                (f"{a}.k_proj.weight", (nkv * hd, h)),
                (f"{a}.v_proj.weight", (nkv * hd, h)),
                (f"{a}.o_proj.weight", (h, nh * hd)),
                (f"{a}.q_norm.weight", (hd,)),
                (f"{a}.k_norm.weight", (hd,)),
            ]
        shapes.append((f"{p}.post_attention_layernorm.weight", (h,)))
        if moe:
            e, inter = m["num_experts"], m["moe_intermediate_size"]
            shapes += [
                (f"{p}.mlp.gate.weight", (e, h)),
                (f"{p}.mlp.experts.gate_up_proj", (e, 2 * inter, h)),
                (f"{p}.mlp.experts.down_proj", (e, h, inter)),
            ]
            shapes += dense_mlp_shapes(f"{p}.mlp.shared_expert", h, m["shared_expert_intermediate_size"])
            shapes.append((f"{p}.mlp.shared_expert_gate.weight", (1, h)))
        else:
            shapes += dense_mlp_shapes(f"{p}.mlp", h, s["intermediate_size"])
    return shapes + [(n, (h,)) if n == "model.norm.weight" else (n, (SHAPE["vocab_size"], h)) for n, _ in head_shapes()]


def _tiny(moe: bool) -> TinyCheckpoint:
    return TinyCheckpoint(
        config=lambda eos_token_id: config_dict(eos_token_id, moe=moe),
        parameter_shapes=lambda: parameter_shapes(moe=moe),
        marker={"qwen3_5": {**QWEN35_SHAPE, **(MOE_SHAPE if moe else {})}, "chat_tokens": list(CHAT_TOKENS)},
        extra_tokens=CHAT_TOKENS,
        chat_template=CHAT_TEMPLATE,
        norm_weight=norm_weight,
    )


def norm_weight(name: str) -> float:
    """Qwen3.5's norms scale by 1 + weight (0.0 is their identity), but for the linear attention's gated norm, which
    scales by its weight (transformers' init for each)."""
    return 1.0 if name.endswith("linear_attn.norm.weight") else 0.0


TINY, TINY_MOE = _tiny(False), _tiny(True)
