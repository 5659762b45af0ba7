"""Expert parallelism: the `ep` mesh axis for MoE models (placement of expert weights, refusals) and the same
numbers on one device and on a 2-device CPU mesh with the experts split over ep=2, run in a
subprocess as test_sharding.py does (JAX fixes its device count when its backend starts)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from moe_checkpoint import build_moe_model
from test_sharding import _compare, _run_scenario

from tinkerflow.workers.engine.model.families import ModelConfig
from tinkerflow.workers.engine.model.sharding import check_divisible, param_spec


def _config(**kw) -> ModelConfig:
    hf = dict(
        model_type="qwen3_moe",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    return ModelConfig.from_hf({**hf, **kw})


def _mesh(fsdp: int, tp: int, ep: int = 1) -> Any:  # a stand-in Mesh: the code under test reads .shape
    return SimpleNamespace(shape={"fsdp": fsdp, "tp": tp, **({"ep": ep} if ep > 1 else {})})


def test_expert_param_specs():
    cfg, mesh = _config(), _mesh(2, 1, 2)

    def spec(*path):
        return param_spec(path, (1, 1, 1), cfg, mesh)

    experts = ("layers", 0, "mlp", "experts")
    assert spec(*experts, "gate_proj", "kernel") == P("ep", "fsdp", "tp")
    assert spec(*experts, "down_proj", "kernel") == P("ep", "tp", "fsdp")
    assert spec(*experts, "up_proj", "lora_a") == P(None, "ep", "fsdp", None)
    assert spec(*experts, "down_proj", "lora_b") == P(None, "ep", None, "fsdp")
    assert param_spec(("layers", 0, "mlp", "gate", "kernel"), (64, 8), cfg, mesh) == P(None, None)  # router: replicated
    assert spec("layers", 0, "self_attn", "q_proj", "kernel") == P("fsdp", "tp")  # dense rules unchanged
    # Without an ep axis the expert axis is unsharded.
    assert param_spec((*experts, "gate_proj", "kernel"), (1, 1, 1), cfg, _mesh(2, 1)) == P(None, "fsdp", "tp")


@pytest.mark.parametrize(
    "kw,mesh,message",
    [
        ({"num_experts": 6}, (1, 1, 4), "num_experts=6 is not divisible by the mesh's ep=4"),
        (
            {"moe_intermediate_size": 30, "num_key_value_heads": 4},
            (1, 4, 1),
            "moe_intermediate_size=30 is not divisible by the mesh's tp=4",
        ),
    ],
)
def test_indivisible_expert_shapes_are_refused(kw, mesh, message):
    with pytest.raises(ValueError, match=message):
        check_divisible(_config(**kw), _mesh(*mesh))


def test_ep_axis_needs_experts():
    dense = ModelConfig.from_hf(
        dict(
            model_type="qwen3",
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(ValueError, match="ep=2 needs a mixture-of-experts model"):
        check_divisible(dense, _mesh(1, 1, 2))


def test_expert_parallel_mesh_matches_one_device(tmp_path):
    """Two adapters in one batch, a step, and greedy sampling of a snapshot (prefill with prompt logprobs, decode) on a
    one-layer Qwen3-MoE whose only MLP is routed: its 8 experts split 4 and 4 over ep=2 against one device, both in one
    2-device subprocess (fsdp and tp are the dense rules, tested in test_sharding.py).

    Kept cheap: one layer (the dense layer of the usual tiny MoE adds compile time, not coverage: dense MLPs are
    replicated over ep), one decode-slot bucket, so each side compiles one train step, one admission and one decode
    program, and LLVM's cheap passes for both sides (--fast-compile): about 40 s of CPU in all. With seed 1 the
    scenario's tokens are routed to experts of both halves (checked once with transformers' router logits: rows use
    experts {0,1,2,3,4,5,7}, {1,...,7}, {0,...,5}, the prompt {0,1,2,3,5,7}), so both devices compute."""
    model_dir = build_moe_model(tmp_path / "moe", seed=1, layers=1, mlp_only_layers=())
    out = tmp_path / "moe.npz"
    _run_scenario(model_dir, out, "--quick", "--fast-compile", "--meshes", "1x1,1x1x2")
    results = dict(np.load(out))
    assert len(results["1x1/greedy_tokens"]) == 8
    assert any(k.startswith("1x1/grad0/layers.0.mlp.experts.") for k in results)  # expert LoRA took part
    _compare(results, "1x1x2")
