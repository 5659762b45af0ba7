# pyright: reportOptionalMemberAccess=false
# (this test reads Optional results where a None fails the test at once, as an assert would)
"""Sharding on an fsdp x tp mesh: placement rules, refusal of shapes that do not divide, and the same numbers on
one device and on 2-device CPU meshes (fsdp=2, tp=2), run in a subprocess because JAX fixes its device count when
its backend starts (this process keeps its single device)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tinkerflow.workers.engine.model.families import ModelConfig
from tinkerflow.workers.engine.model.sharding import MeshConfig, as_mesh, check_divisible, param_spec

SCENARIO = Path(__file__).with_name("mesh_scenario.py")
# float32 sums split across devices add in another order: compare to 1e-5 of each array's scale.
REL = 1e-5


def _config(**kw) -> ModelConfig:
    hf = dict(
        model_type="qwen3",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return ModelConfig.from_hf({**hf, **kw})


def _mesh(fsdp: int, tp: int) -> Any:  # a stand-in Mesh: the code under test reads .shape
    return SimpleNamespace(shape={"fsdp": fsdp, "tp": tp})


def test_default_mesh_is_all_devices_on_fsdp():
    mesh = as_mesh(None)
    assert mesh.axis_names == ("fsdp", "tp") and mesh.shape["tp"] == 1 and mesh.size == len(mesh.devices.flat)
    with pytest.raises(ValueError, match="needs 2 devices"):
        MeshConfig(fsdp=2, tp=1).build()


@pytest.mark.parametrize(
    "kw,mesh,message",
    [
        ({}, (1, 4), "num_key_value_heads=2 is not divisible by the mesh's tp=4"),
        ({"num_key_value_heads": 1}, (1, 2), "num_key_value_heads=1 is not divisible by the mesh's tp=2"),
        ({"intermediate_size": 130}, (1, 4), "num_key_value_heads=2"),
        (
            {"intermediate_size": 130, "num_attention_heads": 4, "num_key_value_heads": 4},
            (1, 4),
            "intermediate_size=130 is not divisible by the mesh's tp=4",
        ),
        ({"hidden_size": 66}, (4, 1), "hidden_size=66 is not divisible by the mesh's fsdp=4"),
    ],
)
def test_indivisible_shapes_are_refused(kw, mesh, message):
    with pytest.raises(ValueError, match=message):
        check_divisible(_config(**kw), _mesh(*mesh))


def test_param_specs():
    cfg, mesh = _config(), _mesh(2, 2)

    def spec(*path, shape=(1, 1, 1)):
        return param_spec(path, shape, cfg, mesh)

    assert spec("layers", 0, "self_attn", "q_proj", "kernel") == P("fsdp", "tp")
    assert spec("layers", 0, "self_attn", "q_proj", "lora_a") == P(None, "fsdp", None)
    assert spec("layers", 0, "self_attn", "q_proj", "lora_b") == P(None, None, "tp")
    assert spec("layers", 0, "mlp", "down_proj", "kernel") == P("tp", "fsdp")
    assert spec("layers", 0, "mlp", "down_proj", "lora_a") == P(None, "tp", None)
    assert spec("layers", 0, "mlp", "down_proj", "lora_b") == P(None, None, "fsdp")
    assert spec("embed_tokens", "weight") == P("tp", "fsdp")
    assert spec("lm_head", "lora_b") == P(None, None, "tp")
    assert spec("layers", 1, "input_layernorm", "weight", shape=(64,)) == P(None)
    # A vocabulary the tp size does not divide stays replicated rather than failing.
    assert param_spec(("embed_tokens", "weight"), (301, 64), _config(vocab_size=301), mesh) == P(None, "fsdp")


def _run_scenario(model_dir: Path, out: Path, *args: str) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, str(SCENARIO), str(model_dir), str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def _compare(results, mesh: str, reference: str = "1x1") -> None:
    names = sorted(k.split("/", 1)[1] for k in results if k.startswith(reference + "/"))
    assert names and all(f"{mesh}/{n}" in results for n in names)
    for name in names:
        want, got = results[f"{reference}/{name}"], results[f"{mesh}/{name}"]
        if want.dtype.kind in "iu":
            np.testing.assert_array_equal(got, want, err_msg=f"{mesh} {name}")
        else:
            scale = float(np.abs(want).max()) if want.size else 0.0
            np.testing.assert_allclose(got, want, rtol=REL, atol=REL * scale + 1e-9, err_msg=f"{mesh} {name}")


def _scenario_module():
    spec = importlib.util.spec_from_file_location("mesh_scenario", SCENARIO)
    module = importlib.util.module_from_spec(spec)  # pyright: ignore[reportArgumentType] (the file exists)
    spec.loader.exec_module(module)
    return module


def test_two_device_meshes_match_one_device(engine, qwen3_dir, tmp_path):
    """forward_backward (two adapters in one batch) + optim_step + sampling a snapshot, on fsdp=2 and tp=2 in a
    2-device subprocess, against this process's 1-device engine (same slots and ranks, so its compiles are reused);
    loading on a mesh whose tp does not divide num_key_value_heads fails naming the value."""
    bad = tmp_path / "bad"
    bad.mkdir()
    config = json.loads((qwen3_dir / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 1}))
    out = tmp_path / "quick.npz"
    stdout = _run_scenario(qwen3_dir, out, "--quick", "--meshes", "2x1,1x2", "--expect-error", f"{bad}:1x2")
    assert "num_key_value_heads=1 is not divisible by the mesh's tp=2" in stdout
    scenario = _scenario_module()
    assert (engine.max_lora_adapters, engine.max_lora_rank) == (scenario.MAX_ADAPTERS, scenario.MAX_RANK)
    results = {**np.load(out), **{f"1x1/{k}": v for k, v in scenario.run(engine, quick=True).items()}}
    assert len(results["1x1/greedy_tokens"]) == 8
    for mesh in ("2x1", "1x2"):
        _compare(results, mesh)


@pytest.mark.slow
def test_two_device_meshes_match_one_device_full(qwen3_dir, tmp_path):
    """The whole scenario (forward-only pass after the step, seeded samples) with gradient checkpointing on."""
    out = tmp_path / "full.npz"
    _run_scenario(qwen3_dir, out, "--meshes", "1x1,2x1,1x2", "--gradient-checkpointing")
    results = np.load(out)
    for mesh in ("2x1", "1x2"):
        _compare(results, mesh)
