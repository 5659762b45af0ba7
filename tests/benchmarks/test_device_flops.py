"""The device check's FLOP conventions (benchmarks/device_phases/flops.py): the counts its utilisations divide by,
and the re-reading of the published 6·N figure that docs/benchmarks-gpu.md quotes."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.device_phases.attention import segment_lengths
from benchmarks.device_phases.flops import causal_pairs, decode_floor_bytes, train_flops
from benchmarks.device_phases.shapes import QWEN3_8B, matmul_params
from benchmarks.device_phases.tenants import tenant_lengths


def qwen3_8b_lora_params(rank: int) -> tuple[int, int]:
    """LoRA parameters of every target (q, k, v, o, gate, up, down per layer, and the unembedding) at `rank`."""
    h, i, v, kv = 4096, 12288, 151936, 8 * 128
    layer = rank * ((h + h) + 2 * (h + kv) + (h + h) + 2 * (h + i) + (i + h))
    unembed = rank * (h + v)
    return 36 * layer + unembed, unembed


def test_causal_pairs_count_real_tokens_only():
    assert causal_pairs([1, 2, 3]) == 1 + 3 + 6
    seg = np.array([[1, 1, 1, 2, 2, 0, 0, 0]])  # two packed sequences, three padding tokens
    assert segment_lengths(seg) == [3, 2]
    assert causal_pairs(segment_lengths(seg)) == 6 + 3


def test_lora_model_flops_are_4n_plus_attention_plus_adapters_and_hfu_adds_the_recompute():
    cfg = {"num_attention_heads": 2, "head_dim": 4, "num_hidden_layers": 3, "hidden_size": 8, "vocab_size": 10}
    n, p, p_unembed = 1000, 50, 5
    f = train_flops(cfg, n, [4, 2], p, p_unembed)
    attention = 4 * 4 * 2 * 3 * (10 + 3)
    assert f["attention"] == attention
    assert f["flops_6n"] == 6 * n * 6
    assert f["model"] == 6 * (4 * n + 6 * p) + 3 * attention
    assert f["hardware"] == f["model"] + 6 * 2 * ((n - 80) + (p - p_unembed)) + attention


def test_the_published_40_percent_by_6n_is_about_28_percent_by_the_lora_convention():
    n = matmul_params(QWEN3_8B)
    assert n == pytest.approx(7.57e9, rel=0.005)
    p, p_unembed = qwen3_8b_lora_params(32)
    tokens_per_s, peak, rows = 8801, 989e12, 8
    f = train_flops(QWEN3_8B, n, [1024] * rows, p, p_unembed)
    seconds = 1024 * rows / tokens_per_s
    assert f["flops_6n"] / seconds / peak == pytest.approx(0.404, abs=0.001)
    assert f["model"] / seconds / peak == pytest.approx(0.282, abs=0.002)
    assert f["hardware"] > f["model"]


def test_decode_floor_leaves_out_the_gathered_embedding_unless_tied():
    assert decode_floor_bytes(100, 30, tied=False, kv_bytes=7) == 77
    assert decode_floor_bytes(100, 30, tied=True, kv_bytes=7) == 107


def test_tenant_lengths_sum_to_the_tenants_tokens_none_below_the_shortest():
    rng = np.random.default_rng(0)
    for _ in range(50):
        lengths = tenant_lengths(rng, 1024, 8)
        assert sum(lengths) == 1024
        assert min(lengths) >= 8
