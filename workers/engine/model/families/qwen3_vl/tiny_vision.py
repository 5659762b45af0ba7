"""The tiny Qwen3-VL (`make-tiny-model --family qwen3_vl --vision`): the tiny Qwen3's text model with Qwen3-VL's
interleaved M-RoPE inside `Qwen3VLForConditionalGeneration`'s composite checkpoint, with the tiny Qwen3.5's vision
tower plus one DeepStack merger (its first block's patches also feed the first decoder layer), the same
preprocessor_config.json and the vision tokens (qwen3_5/tiny_vision.py writes both the same way).
"""

from __future__ import annotations

from typing import Any

from ...tiny_shapes import SHAPE
from .. import TinyCheckpoint
from ..qwen3.tiny import config_dict as qwen3_config_dict
from ..qwen3.tiny import parameter_shapes as qwen3_parameter_shapes
from ..qwen3_5.tiny import CHAT_TOKENS
from ..qwen3_5.tiny_vision import (
    PREPROCESSOR_CONFIG,
    VISION_SHAPE,
    composite,
    under_language_model,
    vision_config_dict,
    vision_parameter_shapes,
)

DEEPSTACK = (0,)


def config_dict(eos_token_id: int) -> dict[str, Any]:
    """Qwen3VLForConditionalGeneration's config.json: the tiny Qwen3's text config with Qwen3-VL's interleaved
    M-RoPE (sections of the head's 16 rotary pairs for time, rows and columns)."""
    text = {**qwen3_config_dict(eos_token_id), "model_type": "qwen3_vl_text"}
    for key in ("layer_types", "max_window_layers", "sliding_window", "use_sliding_window", "rope_theta"):
        text.pop(key, None)
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": SHAPE["rope_theta"],
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    }
    vision = vision_config_dict(SHAPE["hidden_size"], DEEPSTACK)
    return composite("Qwen3VLForConditionalGeneration", "qwen3_vl", eos_token_id, text, vision)


def parameter_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """The tiny Qwen3's tensors under `model.language_model.`, then the tower's with its DeepStack mergers."""
    return under_language_model(qwen3_parameter_shapes()) + vision_parameter_shapes(SHAPE["hidden_size"], DEEPSTACK)


TINY_VISION = TinyCheckpoint(
    config=config_dict,
    parameter_shapes=parameter_shapes,
    marker={
        "qwen3_vl": dict(SHAPE),
        "chat_tokens": list(CHAT_TOKENS),
        "vision": {**VISION_SHAPE, "deepstack": list(DEEPSTACK), "preprocessor": PREPROCESSOR_CONFIG},
    },
    norm_weight=lambda name: 1.0,
    extra_tokens=CHAT_TOKENS,
    extra_json={"preprocessor_config.json": PREPROCESSOR_CONFIG},
)
