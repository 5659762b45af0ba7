"""Qwen3 (transformers' `qwen3`, Qwen3ForCausalLM): the dense decoder with per-head q/k RMSNorm.

`family.py` answers the family interface; `tiny.py` is its tiny offline checkpoint (the embedded default model)."""

MODEL_TYPES = ("qwen3",)
