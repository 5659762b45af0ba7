"""Qwen3-MoE (transformers' `qwen3_moe`, Qwen3MoeForCausalLM): Qwen3's attention with model/moe.py's routed experts
as the MLP of the layers its config makes sparse (`decoder_sparse_step`, `mlp_only_layers`), a dense MLP elsewhere.

`config.py` reads its expert settings, `checkpoint.py` stacks its per-expert tensors, `tiny.py` is its tiny offline
checkpoint, and `family.py` answers the family interface with them."""

MODEL_TYPES = ("qwen3_moe",)
