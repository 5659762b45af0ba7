"""The small Qwen3 configuration the layer-loop and checkpointing tests build their models from (no checkpoint:
transformers' own Qwen3Config, read as a checkpoint's config.json would be)."""

from __future__ import annotations

from tinkerflow.workers.engine.model.families import ModelConfig


def qwen3_config(layers: int = 2, max_position: int = 256) -> ModelConfig:
    from transformers import Qwen3Config

    hf = Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_position,
        architectures=["Qwen3ForCausalLM"],
    )
    return ModelConfig.from_hf(hf.to_dict())
