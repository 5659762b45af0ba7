"""The model and its files: the model families (`families/`, one folder each, and the `ModelConfig` they read), the
building blocks they share (attention, the decoder layer, the routed experts, LoRA), loading, how parameters lie
on the device mesh (sharding), adapter checkpoint formats, and the tiny test checkpoints."""
