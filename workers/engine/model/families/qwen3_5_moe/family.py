"""Qwen3.5-MoE's answers: qwen3_5's, under its own name, with its tiny checkpoint."""

from __future__ import annotations

from ..qwen3_5.family import family
from ..qwen3_5.tiny import TINY_MOE

FAMILY = family("qwen3_5_moe", TINY_MOE)
