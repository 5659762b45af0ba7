"""Qwen3-MoE: Qwen3 attention with routed experts."""
