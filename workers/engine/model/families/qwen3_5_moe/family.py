"""Qwen3.5-MoE's answers: qwen3_5's, under its own name."""

from __future__ import annotations

from ..qwen3_5.family import family

FAMILY = family("qwen3_5_moe", None)
