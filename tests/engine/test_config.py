import numpy as np
import pytest

from tinkerflow.workers.engine.model.families import ModelConfig
from tinkerflow.workers.engine.shape_buckets import round_up_pow2, round_up_seq_len

BASE = dict(
    model_type="qwen3",
    vocab_size=10,
    hidden_size=8,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=4,
)


def test_rope_theta_read_from_both_layouts():
    assert ModelConfig.from_hf({**BASE, "rope_theta": 1234.0}).rope_theta == 1234.0
    nested = {**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 777.0}}
    assert ModelConfig.from_hf(nested).rope_theta == 777.0


def test_unsupported_architecture_is_named():
    with pytest.raises(ValueError, match=r"mixtral.*MixtralForCausalLM"):
        ModelConfig.from_hf({**BASE, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"]})


def test_llama3_rope_scaling_matches_transformers():
    pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, rope_parameters=rope)
    ours = ModelConfig.from_hf({**hf.to_dict(), "model_type": "llama"})
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    np.testing.assert_allclose(ours.inv_freq(), ref.numpy(), rtol=1e-6)


def test_buckets():
    assert [round_up_seq_len(n) for n in (1, 16, 17, 24, 25, 33, 100)] == [16, 16, 24, 24, 32, 48, 128]
    assert [round_up_pow2(n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
