"""The model and its files: config, the decoder with its LoRA and MoE layers, loading, adapter checkpoint formats,
and the tiny test checkpoints."""
