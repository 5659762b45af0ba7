"""Qwen3-VL-MoE (transformers' `qwen3_vl_moe`, `Qwen3VLMoeForConditionalGeneration`): Qwen3-VL with Qwen3-MoE's
routed-expert layers. Everything but its name and tiny checkpoint is qwen3_vl's (its family.py); the experts are
model/moe.py's, placed by qwen3_moe's names from either fused layout (qwen3_vl/checkpoint.py)."""

MODEL_TYPES = ("qwen3_vl_moe",)
