"""The gradient-checkpointing level per micro-batch (model/remat.py): the memory plan's thresholds (a fake device),
the step's choice and its programs' labels, and that the warm-up builds the very program the step then runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_scan_layers import _config

from benchmarks.device_phases.shapes import QWEN3_8B
from tinkerflow.workers.engine import warm_up
from tinkerflow.workers.engine.model.decoder import CausalLM
from tinkerflow.workers.engine.model.families import ModelConfig
from tinkerflow.workers.engine.model.layer_costs import saved_matmul_bytes
from tinkerflow.workers.engine.model.remat import Remat
from tinkerflow.workers.engine.model.sharding import DeviceLayout, MeshConfig, as_mesh
from tinkerflow.workers.engine.runtime import memory_plan
from tinkerflow.workers.engine.training.steps import StepFunctions, pack, program_label


def _plan(monkeypatch, capacity_gib: int) -> memory_plan.MemoryPlan:
    cap = capacity_gib * 2**30
    monkeypatch.setattr(memory_plan, "device_capacity", lambda override=0: ("gpu memory", cap, 18 * 2**30))
    cfg = ModelConfig.from_hf(QWEN3_8B)
    return memory_plan.make_plan(cfg, np.dtype("bfloat16"), max_lora_rank=32, snapshot_bytes=0, max_position=40960)


def test_the_plan_picks_the_least_recomputation_that_fits_each_length(monkeypatch):
    plan = _plan(monkeypatch, 141)  # an H200
    cfg = ModelConfig.from_hf(QWEN3_8B)
    # Keeping everything > keeping the matmul outputs > keeping layer inputs, per token.
    assert plan.train_bytes_per_token_no_remat > plan.train_bytes_per_token_dots > plan.train_bytes_per_token
    # DOTS = FULL + every layer's saved matmul outputs (the formula beside per_token_costs).
    saved = plan.train_bytes_per_token_dots - plan.train_bytes_per_token
    assert saved == 36 * saved_matmul_bytes(cfg, 32)
    share = int(plan.work_bytes * memory_plan.NO_REMAT_SHARE)
    lo, hi = plan.remat_min_tokens, plan.full_remat_min_tokens
    assert 1 < lo < hi
    # Each threshold is the most tokens whose activations at the cheaper level fit the share (below it: they fit).
    assert lo * plan.train_bytes_per_token_no_remat <= share < (lo + 1) * plan.train_bytes_per_token_no_remat
    assert hi * plan.train_bytes_per_token_dots <= share < (hi + 1) * plan.train_bytes_per_token_dots
    assert [plan.remat_for(n) for n in (1, lo - 1, lo, hi - 1, hi, 10 * hi)] == [
        Remat.NONE,
        Remat.NONE,
        Remat.DOTS,
        Remat.DOTS,
        Remat.FULL,
        Remat.FULL,
    ]
    assert {lvl: plan.train_bytes_at(lvl) for lvl in Remat} == {
        Remat.NONE: plan.train_bytes_per_token_no_remat,
        Remat.DOTS: plan.train_bytes_per_token_dots,
        Remat.FULL: plan.train_bytes_per_token,
    }


def test_a_smaller_device_moves_both_thresholds_down(monkeypatch):
    big, small = _plan(monkeypatch, 141), _plan(monkeypatch, 80)
    assert small.remat_min_tokens < big.remat_min_tokens and small.full_remat_min_tokens < big.full_remat_min_tokens


def _batch(steps, rows: int, seq: int):
    return steps.placement.put_batch(pack([], [], steps.placement.round_rows(rows), seq, 1))


def test_gradient_checkpointing_means_always_full():
    config = _config(2)
    model = nnx.eval_shape(lambda: CausalLM(config, max_adapters=2, max_rank=4, rngs=nnx.Rngs(0)))
    graphdef, _, _ = nnx.split(model, nnx.LoRAParam, nnx.Param)
    layout = DeviceLayout(as_mesh(MeshConfig(fsdp=1, tp=1)), config)
    always = StepFunctions(graphdef, layout, gradient_checkpointing=True)
    by_length = StepFunctions(graphdef, layout)
    by_length.remat_min_tokens, by_length.full_remat_min_tokens = 64, 128
    for rows, level in ((1, Remat.NONE), (2, Remat.DOTS), (4, Remat.FULL)):
        batch = pack([], [], rows, 32, 1)
        assert always.remat(batch) is Remat.FULL
        assert by_length.remat(batch) is level, rows


@pytest.mark.parametrize("rows,level", [(1, Remat.NONE), (2, Remat.DOTS), (4, Remat.FULL)])
def test_the_warm_up_builds_the_program_the_step_runs_labelled_with_its_level(engine, monkeypatch, rows, level):
    steps = engine.steps
    monkeypatch.setattr(steps, "remat_min_tokens", 2 * 32)
    monkeypatch.setattr(steps, "full_remat_min_tokens", 4 * 32)
    batch = _batch(steps, rows, 32)
    assert steps.remat(batch) is level
    warm_up._train(engine, rows, 32)  # compiles (runs nothing)
    built = steps.grad_step.compiles
    acc = jax.tree.map(jnp.zeros_like, engine.adapters.grads)  # the step donates its accumulator: not the engine's
    steps.grad(engine.adapters.lora, engine.base, acc, batch)
    assert steps.grad_step.compiles == built  # the step's program is the warm-up's
    label = program_label(batch, level)
    assert (" remat=" in label) is (level is not Remat.NONE) and label.endswith(
        "" if level is Remat.NONE else level.value
    )
    assert any(d.startswith(f"{label} (warm-up)") for d in steps.grad_step.compile_seconds), label


@pytest.mark.parametrize("level", [Remat.DOTS, Remat.FULL], ids=["dots", "full"])
def test_the_plan_never_underestimates_what_xla_allocates_at_each_level(engine, monkeypatch, level):
    """As test_long_sequences' check of the plan at the engine's own level, for a datum of 2,048 tokens forced to
    `level`: XLA's figure for the compiled train step is within the plan's fixed part plus its per-token cost."""
    steps, plan = engine.steps, engine.memory
    monkeypatch.setattr(steps, "forced_remat", level)
    n = 2048
    batch = _batch(steps, 1, n)
    needed = steps.needed_bytes(engine.adapters.lora, engine.base, engine.adapters.grads, batch, train=True)
    logits = 3 * engine.info.vocab_size * 4 * n  # this model's whole sequence is one chunk of the vocabulary
    assert needed <= n * plan.train_bytes_at(level) + min(logits, plan.train_fixed_bytes), (needed, level)
