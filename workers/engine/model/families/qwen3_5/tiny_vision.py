"""The tiny Qwen3.5 vision-language model (`make-tiny-model --family qwen3_5 --vision`): the tiny Qwen3.5's text model
inside `Qwen3_5ForConditionalGeneration`'s composite checkpoint, as transformers 5.23 writes it: config.json with
`text_config` and `vision_config`, the text tensors under `model.language_model.*`, the vision tower's under
`model.visual.*` (the names vision_checkpoint.py reads), and a preprocessor_config.json in the fields of
transformers' `Qwen2VLImageProcessor` (what tinkerflow.common.images reads, and what the API counts an image's tokens
with). The tokenizer is the tiny Qwen3.5's, which already carries the vision tokens.

The tiny Qwen3-VL (qwen3_vl/tiny_vision.py) is the same tower with one DeepStack merger, written by the helpers here.

The tower is small (2 blocks of width 32 on 2 heads, Qwen3.5's patch 16, temporal patch 2 and merge 2) and its image
processor keeps images between 64 x 64 and 256 x 256 pixels, so an image is 4 to 64 placeholder tokens and a test's
prompts stay far inside the tiny model's 2,048 positions.
"""

from __future__ import annotations

from typing import Any

from ...tiny_tokenizer import SPECIAL_TOKENS
from .. import TinyCheckpoint
from .tiny import CHAT_TEMPLATE, CHAT_TOKENS, QWEN35_SHAPE, config_dict, norm_weight, parameter_shapes

VISION_SHAPE: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 64,  # an 8 x 8 learned table, resampled to each image's grid
    "hidden_act": "gelu_pytorch_tanh",
}
# Qwen2VLImageProcessor's fields as transformers 5.23 saves them; pixels between (2 * 32)**2 and (8 * 32)**2.
PREPROCESSOR_CONFIG: dict[str, Any] = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_size": 2,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "resample": 3,
    "rescale_factor": 1 / 255,
    "size": {"shortest_edge": 64 * 64, "longest_edge": 256 * 256},
}
_TEXT_PREFIX = "model.language_model."


def token_id(eos_token_id: int, token: str) -> int:
    """The tiny tokenizer's id of a chat token: specials follow the BPE vocabulary in order, EOS first."""
    return eos_token_id + len(SPECIAL_TOKENS) + CHAT_TOKENS.index(token)


def vision_config_dict(out_hidden_size: int, deepstack: tuple[int, ...] = ()) -> dict[str, Any]:
    """The tower's config (Qwen3-VL's with its DeepStack blocks when `deepstack` names them)."""
    config = {
        **VISION_SHAPE,
        "model_type": "qwen3_vl_vision" if deepstack else "qwen3_5_vision",
        "out_hidden_size": out_hidden_size,
        "initializer_range": 0.02,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
    }
    return {**config, "deepstack_visual_indexes": list(deepstack)} if deepstack else config


def composite(architecture: str, model_type: str, eos_token_id: int, text: dict[str, Any], vision: dict[str, Any]):
    import transformers

    text.pop("architectures", None)
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "dtype": "float32",
        "image_token_id": token_id(eos_token_id, "<|image_pad|>"),
        "video_token_id": token_id(eos_token_id, "<|video_pad|>"),
        "vision_start_token_id": token_id(eos_token_id, "<|vision_start|>"),
        "vision_end_token_id": token_id(eos_token_id, "<|vision_end|>"),
        "tie_word_embeddings": text["tie_word_embeddings"],
        "text_config": text,
        "vision_config": vision,
        "transformers_version": transformers.__version__,
    }


def composite_config_dict(eos_token_id: int) -> dict[str, Any]:
    """Qwen3_5ForConditionalGeneration's config.json: the tiny text config as its `text_config`."""
    text = config_dict(eos_token_id, moe=False)
    vision = vision_config_dict(QWEN35_SHAPE["hidden_size"])
    return composite("Qwen3_5ForConditionalGeneration", "qwen3_5", eos_token_id, text, vision)


def _merger(prefix: str, h: int, merged: int, out: int, norm: int) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (f"{prefix}.norm.weight", (norm,)),
        (f"{prefix}.norm.bias", (norm,)),
        (f"{prefix}.linear_fc1.weight", (merged, merged)),
        (f"{prefix}.linear_fc1.bias", (merged,)),
        (f"{prefix}.linear_fc2.weight", (out, merged)),
        (f"{prefix}.linear_fc2.bias", (out,)),
    ]


def vision_parameter_shapes(out_hidden_size: int, deepstack: tuple[int, ...] = ()) -> list[tuple[str, tuple[int, ...]]]:
    """The tower's tensors in transformers' names (`Qwen3_5VisionModel`, `Qwen3VLVisionModel` with `deepstack`,
    under `model.visual`)."""
    v = VISION_SHAPE
    h, inter, p, t = v["hidden_size"], v["intermediate_size"], v["patch_size"], v["temporal_patch_size"]
    merged = h * v["spatial_merge_size"] ** 2
    pre = "model.visual"
    shapes: list[tuple[str, tuple[int, ...]]] = [
        (f"{pre}.patch_embed.proj.weight", (h, v["in_channels"], t, p, p)),
        (f"{pre}.patch_embed.proj.bias", (h,)),
        (f"{pre}.pos_embed.weight", (v["num_position_embeddings"], h)),
    ]
    for i in range(v["depth"]):
        b = f"{pre}.blocks.{i}"
        shapes += [
            (f"{b}.norm1.weight", (h,)),
            (f"{b}.norm1.bias", (h,)),
            (f"{b}.norm2.weight", (h,)),
            (f"{b}.norm2.bias", (h,)),
            (f"{b}.attn.qkv.weight", (3 * h, h)),
            (f"{b}.attn.qkv.bias", (3 * h,)),
            (f"{b}.attn.proj.weight", (h, h)),
            (f"{b}.attn.proj.bias", (h,)),
            (f"{b}.mlp.linear_fc1.weight", (inter, h)),
            (f"{b}.mlp.linear_fc1.bias", (inter,)),
            (f"{b}.mlp.linear_fc2.weight", (h, inter)),
            (f"{b}.mlp.linear_fc2.bias", (h,)),
        ]
    shapes += _merger(f"{pre}.merger", h, merged, out_hidden_size, h)
    for k in range(len(deepstack)):  # DeepStack's mergers normalise after the 2 x 2 shuffle
        shapes += _merger(f"{pre}.deepstack_merger_list.{k}", h, merged, out_hidden_size, merged)
    return shapes


def under_language_model(shapes: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """A causal LM's tensors as a composite checkpoint names them (lm_head stays top-level)."""
    return [(_TEXT_PREFIX + n[len("model.") :] if n.startswith("model.") else n, s) for n, s in shapes]


def composite_parameter_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """The text model's tensors under `model.language_model.`, then the tower's."""
    return under_language_model(parameter_shapes(moe=False)) + vision_parameter_shapes(QWEN35_SHAPE["hidden_size"])


def _norm_weight(name: str) -> float:
    """The text model's norms as the tiny Qwen3.5 draws them; the tower's LayerNorms at their identity (weight 1)."""
    return 1.0 if name.startswith("model.visual.") else norm_weight(name)


TINY_VISION = TinyCheckpoint(
    config=composite_config_dict,
    parameter_shapes=composite_parameter_shapes,
    marker={
        "qwen3_5": dict(QWEN35_SHAPE),
        "chat_tokens": list(CHAT_TOKENS),
        "vision": {**VISION_SHAPE, "preprocessor": PREPROCESSOR_CONFIG},
    },
    norm_weight=_norm_weight,
    extra_tokens=CHAT_TOKENS,
    chat_template=CHAT_TEMPLATE,
    extra_json={"preprocessor_config.json": PREPROCESSOR_CONFIG},
)
