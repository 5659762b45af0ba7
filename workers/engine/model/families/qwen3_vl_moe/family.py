"""Qwen3-VL-MoE's answers: Qwen3-VL's (qwen3_vl/family.py) with Qwen3-MoE's layers and costs."""

from __future__ import annotations

from ..qwen3_vl.family import family

FAMILY = family("qwen3_vl_moe", moe=True)
