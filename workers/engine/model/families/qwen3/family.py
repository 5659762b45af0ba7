"""Qwen3's answers: model/'s dense decoder layer with q/k norm, the shared checkpoint names, LoRA targets and costs."""

from __future__ import annotations

from typing import Any

from ...decoder import DECODER_TARGETS, dense_layer, dense_stack, kv_every_layer
from ...layer_costs import dense_activation_bytes, dense_params
from ...loader import DecoderNames
from .. import Family, ModelConfig
from .tiny import TINY


def read_config(hf: dict[str, Any]) -> ModelConfig:
    return ModelConfig.read(hf, arch="qwen3", qk_norm=True)


FAMILY = Family(
    name="qwen3",
    read_config=read_config,
    decoder_layer=dense_layer,
    decoder_stack=dense_stack,
    checkpoint_names=DecoderNames,
    lora_targets=DECODER_TARGETS,
    cache_kinds=kv_every_layer,
    matmul_params=dense_params,
    activation_bytes=dense_activation_bytes,
    tiny=TINY,
)
