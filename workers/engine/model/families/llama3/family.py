"""Llama 3's answers: model/'s dense decoder layer without q/k norm, the shared checkpoint names, LoRA targets and
costs. No tiny checkpoint: the embedded default is another family's, and tests build Llama checkpoints with
transformers' LlamaConfig (tests/engine/conftest.py)."""

from __future__ import annotations

from typing import Any

from ...decoder import DECODER_TARGETS, dense_layer, dense_stack, kv_every_layer
from ...layer_costs import dense_activation_bytes, dense_params
from ...loader import DecoderNames
from .. import Family, ModelConfig


def read_config(hf: dict[str, Any]) -> ModelConfig:
    return ModelConfig.read(hf, arch="llama3", qk_norm=False)


FAMILY = Family(
    name="llama3",
    read_config=read_config,
    decoder_layer=dense_layer,
    decoder_stack=dense_stack,
    checkpoint_names=DecoderNames,
    lora_targets=DECODER_TARGETS,
    cache_kinds=kv_every_layer,
    matmul_params=dense_params,
    activation_bytes=dense_activation_bytes,
)
