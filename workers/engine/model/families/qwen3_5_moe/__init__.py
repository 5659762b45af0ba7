"""Qwen3.5-MoE / Qwen3.6-MoE (transformers' `qwen3_5_moe`): Qwen3.5's hybrid decoder with the routed experts plus a
gated shared expert as every layer's MLP. Its modules are qwen3_5's (the config reader picks the MLP); this folder
is its own family so that ModelConfig.arch names the variant, and holds its tiny checkpoint."""

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
