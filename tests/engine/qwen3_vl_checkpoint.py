"""Tiny random Qwen3-VL and Qwen3-VL-MoE checkpoints for the qwen3_vl parity tests, written by transformers 5.23's own
`save_pretrained` (`Qwen3VLForConditionalGeneration`, `Qwen3VLMoeForConditionalGeneration`) with the conftest BPE
tokenizer and a preprocessor_config.json, and loaded by the engine through its normal loader.

Sizes differ from every other test's and from each other so a transposed or swapped axis cannot pass: text hidden 48
in 3 query heads of 16 over 1 key/value head, MLP 80, 3 layers, interleaved M-RoPE sections [3, 3, 2] of the 8 rotary
frequencies; tower hidden 24 in 2 heads of 12, MLP 40, 3 blocks, 8 x 8 pixel patches x 2 frames, merge 2 x 2, a 5 x 5
learned position table, DeepStack features from blocks 0 and 2 into decoder layers 0 and 1; the MoE's layers 0 and 2
route each token to 2 of 4 experts of width 20 and layer 1 is dense. Untied embeddings. The vision tokens follow
the tokenizer's vocabulary.

Weights moved away from their init, so activations are of order one and float32 rounding stays near 1e-6:
linears and experts ~ N(0, 1 / fan_in), biases ~ N(0, 0.1), norm weights ~ 1 + N(0, 0.3) (LayerNorm biases
~ N(0, 0.3)), embeddings and the position table ~ N(0, 0.5), the router ~ N(0, 1) (decisive routing).

The MoE's fused experts are written as published Qwen3-VL-MoE checkpoints keep them (`gate_up_proj` [E, H, 2I],
`down_proj` [E, I, H]: transposed from transformers 5's), which both loaders must turn back.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from conftest import build_tokenizer

PATCH, MERGE, TEMPORAL = 8, 2, 2
TEXT = dict(
    hidden_size=48,
    num_hidden_layers=3,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=80,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
    },
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20, decoder_sparse_step=1, mlp_only_layers=[1])
VISION = dict(
    depth=3,
    hidden_size=24,
    intermediate_size=40,
    num_heads=2,
    in_channels=3,
    patch_size=PATCH,
    temporal_patch_size=TEMPORAL,
    spatial_merge_size=MERGE,
    out_hidden_size=48,
    num_position_embeddings=25,
    deepstack_visual_indexes=[0, 2],
)
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": MERGE,
    "patch_size": PATCH,
    "temporal_patch_size": TEMPORAL,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"shortest_edge": 32 * 32, "longest_edge": 128 * 128},
}


def _value(name: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("embed_tokens.weight") or name.endswith("pos_embed.weight") or name == "lm_head.weight":
        return rng.normal(0.0, 0.5, shape)
    if "norm" in name:
        return 1.0 + rng.normal(0.0, 0.3, shape) if name.endswith("weight") else rng.normal(0.0, 0.3, shape)
    if name.endswith("bias"):
        return rng.normal(0.0, 0.1, shape)
    if name.endswith("mlp.gate.weight"):  # the router
        return rng.normal(0.0, 1.0, shape)
    fan_in = shape[-1] if len(shape) < 5 else int(np.prod(shape[1:]))  # experts [E, out, in]; the Conv3d
    return rng.normal(0.0, 1.0 / np.sqrt(fan_in), shape)


def build_qwen3_vl(directory: Path, *, moe: bool, seed: int = 0) -> Path:
    """Write the checkpoint (module doc) into `directory`; returns it."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    directory.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(directory)
    tokens = {name: vocab + i for i, name in enumerate(["vision_start", "vision_end", "image", "video"])}
    text = {**TEXT, "vocab_size": vocab + len(tokens), **(MOE if moe else {})}
    kind = "Qwen3VLMoe" if moe else "Qwen3VL"
    config = getattr(transformers, f"{kind}Config")(
        text_config=text,
        vision_config=VISION,
        image_token_id=tokens["image"],
        video_token_id=tokens["video"],
        vision_start_token_id=tokens["vision_start"],
        vision_end_token_id=tokens["vision_end"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{kind}ForConditionalGeneration")(config).float()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.asarray(_value(name, list(p.shape), rng), np.float32)))
    model.save_pretrained(directory)
    if moe:  # the published layout of the fused experts (module doc)
        path = directory / "model.safetensors"
        tensors = load_file(str(path))
        for name in [n for n in tensors if ".mlp.experts." in n]:
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
        save_file(tensors, str(path), metadata={"format": "pt"})
    (directory / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return directory
