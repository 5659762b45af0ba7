"""The model shapes the device check draws (random weights) and the datasheet peak its MFU is taken over."""

from __future__ import annotations

# Qwen3-8B's dimensions (benchmarks/train.py writes a checkpoint of them too).
QWEN3_8B_SHAPE = dict(
    hidden_size=4096,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
    tie_word_embeddings=False,
)
QWEN3_8B = dict(
    model_type="qwen3",
    architectures=["Qwen3ForCausalLM"],
    **QWEN3_8B_SHAPE,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
)
QWEN3_06B_2L = {
    **QWEN3_8B,
    "hidden_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "intermediate_size": 3072,
    "tie_word_embeddings": True,
}
TINY = {
    **QWEN3_8B,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
}


def matmul_params(cfg: dict) -> int:
    """Base matmul parameters per token, as the model's family counts them for the worker's MFU."""
    from tinkerflow.activities.accelerator_metrics import params_per_token
    from tinkerflow.workers.engine.model.families import ModelConfig

    return params_per_token(ModelConfig.from_hf(cfg))


def datasheet_peak(kind: str) -> float | None:
    """The device's dense bf16 peak FLOP/s from the worker's datasheet table; None for a device not in it."""
    from tinkerflow.activities.accelerator_metrics import peak_tflops_of

    tflops, source = peak_tflops_of(kind)
    return tflops * 1e12 if source.startswith("table") else None
