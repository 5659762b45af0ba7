"""The tiny Qwen3.5-MoE's LoRA export, routed experts and the shared expert included, merged by tinker-cookbook's
`build_hf_model` into transformers' Qwen3.5-MoE, gives the engine's logprobs (the dense variant's check is in
test_qwen3_5_engine.py)."""

from __future__ import annotations

import numpy as np
import pytest
from cookbook_merge import merged_and_base_logprobs
from safetensors.numpy import load_file

from tinkerflow.workers.engine.engine import Engine
from tinkerflow.workers.engine.model.checkpoint import ADAPTER_WEIGHTS, write_peft
from tinkerflow.workers.engine.model.tiny_model import make_tiny_model
from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, ForwardBackwardResult, LoraConfig

pytestmark = pytest.mark.parity

# As test_qwen3_5_engine.py: float32 on both sides, different summation orders.
TOL = 1e-4
TOKENS = np.array([5, 17, 42, 99, 3, 250, 7, 11, 64, 2, 9, 1500, 33, 8, 120, 6], np.int32)


def test_moe_export_merges_into_transformers_with_the_engines_logprobs(tmp_path):
    pytest.importorskip("tinker_cookbook", reason="the cookbook extra is not installed")

    directory = make_tiny_model(tmp_path / "qwen3_5_moe", family="qwen3_5_moe")
    engine = Engine.load(str(directory), max_lora_adapters=2, max_lora_rank=8, progress=False)
    config = LoraConfig(rank=4, seed=1, train_attn=True, train_mlp=True, train_unembed=True)
    engine.create_adapter(0, config)
    rng = np.random.default_rng(0)
    weights = {k: rng.normal(0, 0.2, v.shape).astype(np.float32) for k, v in engine.adapter_weights(0).items()}
    engine.set_adapter_weights(0, weights)
    datum = Datum(tokens=TOKENS[:-1], inputs={"target_tokens": TOKENS[1:]})
    [res] = engine.forward_backward(
        [ForwardBackwardInput(slot=0, data=[datum], loss_fn="cross_entropy", forward_only=True)]
    )
    assert isinstance(res, ForwardBackwardResult), res
    ours = res.outputs[0]["logprobs"]

    write_peft(config, weights, tmp_path / "adapter", base_model_name_or_path=str(directory))
    keys = set(load_file(str(tmp_path / "adapter" / ADAPTER_WEIGHTS)))
    assert any(".mlp.experts." in k for k in keys), "the routed experts' LoRA is exported"
    assert any(".mlp.shared_expert." in k for k in keys), "the shared expert's LoRA is exported"
    merged, unmerged = merged_and_base_logprobs(directory, tmp_path / "adapter", tmp_path / "merged", TOKENS)
    assert np.abs(ours - unmerged).max() > 100 * TOL, "the adapter moves the logprobs, so the check bites"
    np.testing.assert_allclose(ours, merged, atol=TOL, rtol=TOL)
