"""Which Qwen3-MoE config.json files parse, which MLP each layer gets, and which MoE families are refused (and why)."""

from __future__ import annotations

import pytest

from tinkerflow.workers.engine.model.families import ModelConfig

BASE = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)


def _moe(**kw) -> ModelConfig:
    return ModelConfig.from_hf({"model_type": "qwen3_moe", **BASE, **kw})


def test_qwen3_moe_fields_and_sparse_layers():
    c = _moe(norm_topk_prob=True)
    assert (c.arch, c.qk_norm, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (
        "qwen3_moe",
        True,
        8,
        2,
        32,
        True,
    )
    assert c.moe_layers == (0, 1, 2, 3, 4, 5)
    assert _moe(decoder_sparse_step=2).moe_layers == (1, 3, 5)
    assert _moe(mlp_only_layers=[0, 3]).moe_layers == (1, 2, 4, 5)
    assert _moe(decoder_sparse_step=3, mlp_only_layers=[5]).moe_layers == (2,)
    assert _moe(num_experts=0).moe_layers == ()


def test_transformers5_num_local_experts_spelling():
    hf = {"model_type": "qwen3_moe", **BASE}
    hf["num_local_experts"] = hf.pop("num_experts")
    assert ModelConfig.from_hf(hf).num_experts == 8


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be in"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"quantized checkpoints \(fp8\)"),
        ({"model_type": "qwen2_moe"}, "unsupported architecture 'qwen2_moe'"),
        ({"model_type": "mixtral"}, "unsupported architecture 'mixtral'"),
        ({"model_type": "deepseek_v3"}, "unsupported architecture 'deepseek_v3'"),
        ({"model_type": "qwen3_next"}, "unsupported architecture 'qwen3_next'"),
    ],
)
def test_refused_moe_configs(kw, message):
    with pytest.raises(ValueError, match=message):
        _moe(**kw)
