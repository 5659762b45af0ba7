"""Qwen3-VL's answers: its own causal LM (model.py: decoder.CausalLM with the tower), Qwen3's layers (stacked for the
scan) or Qwen3-MoE's (per layer), the ForConditionalGeneration checkpoint's names, the decoder's LoRA targets (the
tower has none), what the sampler keeps (keys and values of every layer) and the text model's costs. Also the MoE
variant's (qwen3_vl_moe/family.py)."""

from __future__ import annotations

from typing import Any

from ...decoder import DECODER_TARGETS, dense_layer, dense_stack, kv_every_layer
from ...layer_costs import dense_activation_bytes, dense_params
from .. import Family, ModelConfig
from ..qwen3_5.vision_batch import image_batch
from ..qwen3_moe import family as qwen3_moe
from .checkpoint import Qwen3VLNames
from .config import Qwen3VLConfig
from .model import CausalLM
from .tiny_vision import TINY_VISION


def read_config(hf: dict[str, Any]) -> ModelConfig:
    return Qwen3VLConfig.from_hf(hf)


def family(name: str, *, moe: bool, tiny_vision: Any = None) -> Family:
    """The Family of one Qwen3-VL folder: its text layers are Qwen3's, or (`moe`) Qwen3-MoE's."""
    return Family(
        name=name,
        read_config=read_config,
        decoder_layer=qwen3_moe.decoder_layer if moe else dense_layer,
        decoder_stack=None if moe else dense_stack,
        checkpoint_names=Qwen3VLNames,
        lora_targets=DECODER_TARGETS,
        cache_kinds=kv_every_layer,
        matmul_params=qwen3_moe.matmul_params if moe else dense_params,
        activation_bytes=qwen3_moe.activation_bytes if moe else dense_activation_bytes,
        tiny_vision=tiny_vision,
        causal_lm=CausalLM,
        image_batch=image_batch,
    )


FAMILY = family("qwen3_vl", moe=False, tiny_vision=TINY_VISION)
