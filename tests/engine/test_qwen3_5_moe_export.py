"""The tiny Qwen3.5-MoE's LoRA export, routed experts and the shared expert included, merged by tinker-cookbook's
`build_hf_model` into transformers' Qwen3.5-MoE, gives the engine's logprobs (the dense variant's check is in
test_qwen3_5_engine.py)."""

from __future__ import annotations

import numpy as np
import pytest
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
    import torch
    from tinker_cookbook.weights import build_hf_model
    from transformers import AutoModelForCausalLM

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
    build_hf_model(
        base_model=str(directory),
        adapter_path=str(tmp_path / "adapter"),
        output_path=str(tmp_path / "merged"),
        dtype="float32",
        merge_strategy="full",
        device="cpu",
    )
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(TOKENS[None, :-1]).long()).logits[0]
    merged = torch.log_softmax(logits, -1).gather(-1, torch.from_numpy(TOKENS[1:]).long()[:, None])[:, 0].numpy()
    base = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = base(torch.from_numpy(TOKENS[None, :-1]).long()).logits[0]
    unmerged = torch.log_softmax(base_logits, -1).gather(-1, torch.from_numpy(TOKENS[1:]).long()[:, None])[:, 0]
    assert np.abs(ours - unmerged.numpy()).max() > 100 * TOL, "the adapter moves the logprobs, so the check bites"
    np.testing.assert_allclose(ours, merged, atol=TOL, rtol=TOL)
