"""The three gradient-checkpointing levels (model/remat.py) on a tiny dense model, stacked (scan) and per-layer:
NONE, DOTS and FULL give the same loss and LoRA gradients; DOTS's backward runs no forward matmul again (the
lowered program's dot count equals NONE's, FULL's is larger); and XLA's temp memory for DOTS lies between NONE's and
FULL's. Counted and compared, never timed.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from small_qwen3 import qwen3_config

from tinkerflow.workers.engine.model.attention import Segments
from tinkerflow.workers.engine.model.decoder import CausalLM
from tinkerflow.workers.engine.model.families import ModelConfig
from tinkerflow.workers.engine.model.lora import LoraRouting
from tinkerflow.workers.engine.model.remat import DOTS_POLICY, Remat

LEVELS = (Remat.NONE, Remat.DOTS, Remat.FULL)

# float32: DOTS and FULL recompute the same float32 operations from the same saved values; only XLA's fusion of a
# recomputed sum may reorder it (float32 eps 1.2e-7 over sums of up to 128 terms). Measured on this model: at most
# 1.0e-6 relative (the loop layout, DOTS), the scan layout below that.
F32_TOL = 1e-5


def _config(layers: int = 2) -> ModelConfig:
    return qwen3_config(layers)


def _model(*, scan: bool, dtype=jnp.float32, seed: int = 0) -> CausalLM:
    """Random base and LoRA weights (B non-zero, so A's gradient flows; norms near 1)."""
    model = CausalLM(_config(), max_adapters=2, max_rank=4, rngs=nnx.Rngs(0), param_dtype=dtype, scan_layers=scan)
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    filled = [
        (1.0 + 0.1 * jax.random.normal(k, x.shape) if x.ndim == 1 else 0.2 * jax.random.normal(k, x.shape)).astype(
            x.dtype
        )
        for k, x in zip(keys, leaves, strict=True)
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, filled))


def _batch(b: int = 2, t: int = 32, seed: int = 1):
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(0, 300, (b, t)), jnp.int32)
    positions = jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1))
    segments = Segments(jnp.ones((b, t), jnp.int32))
    routing = LoraRouting(adapter=jnp.asarray([0, 1][:b] * (b // 2 or 1), jnp.int32)[:b], scale=jnp.full((b,), 2.0))
    weights = jnp.asarray(rng.normal(size=(b, t, 300)), jnp.float32)
    return tokens, positions, segments, routing, weights


def _loss_and_grad(model: CausalLM, level: Remat, batch):
    graphdef, lora, base = nnx.split(model, nnx.LoRAParam, ...)
    tokens, positions, segments, routing, weights = batch

    def loss(lora, base):
        m = nnx.merge(graphdef, lora, base)
        h, _ = m.hidden(tokens, positions, routing, segments=segments, remat=level)
        return jnp.sum(jax.nn.log_softmax(m.logits(h, routing)) * weights)

    return jax.jit(jax.value_and_grad(loss)), (lora, base)


def _grads(model: CausalLM, level: Remat, batch) -> tuple[float, dict]:
    fn, args = _loss_and_grad(model, level, batch)
    value, grads = fn(*args)
    return float(value), {
        jax.tree_util.keystr(p): np.asarray(g, np.float32) for p, g in jax.tree.leaves_with_path(grads)
    }


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "loop"])
def test_levels_give_the_same_gradients_on_float32(scan):
    model, batch = _model(scan=scan), _batch()
    loss, grads = _grads(model, Remat.NONE, batch)
    assert all(np.abs(g).max() > 0 for g in grads.values())  # every LoRA leaf trains: the comparison means something
    for level in (Remat.DOTS, Remat.FULL):
        other_loss, other = _grads(model, level, batch)
        assert abs(other_loss - loss) <= F32_TOL * abs(loss), level
        for path, g in grads.items():
            assert _rel(other[path], g) <= F32_TOL, f"{level} {path}: {_rel(other[path], g):.2e}"


def _dots_in_program(model: CausalLM, level: Remat, batch) -> int:
    fn, args = _loss_and_grad(model, level, batch)
    return len(re.findall(r"stablehlo\.dot_general", fn.lower(*args).as_text()))


def test_dots_recomputes_no_matmul_and_full_recomputes_them():
    """Counted in the lowered program (one scanned layer body): DOTS's backward holds as many matmuls as NONE's
    (the forward's outputs are saved, nothing is multiplied again), FULL's holds the forward's again."""
    model, batch = _model(scan=True), _batch()
    none, dots, full = (_dots_in_program(model, level, batch) for level in LEVELS)
    assert dots == none < full, (none, dots, full)


def test_the_policy_keeps_the_fused_attention_kernels_outputs():
    """On accelerators attention is a fused kernel whose residuals cannot be named: DOTS keeps its outputs by primitive
    (CPU runs the blockwise attention, whose outputs are named; this checks the policy's rule without a GPU)."""

    class Prim:
        def __init__(self, name: str):
            self.name = name

    assert DOTS_POLICY(Prim("dot_product_attention_fwd_wrapper"))
    assert DOTS_POLICY(Prim("pallas_call"))
    assert not DOTS_POLICY(Prim("dot_general"))
    assert DOTS_POLICY(Prim("name"), name="projection") and not DOTS_POLICY(Prim("name"), name="other")


def test_dots_temp_memory_lies_between_none_and_full():
    """XLA's temp allocation for the compiled gradient at one length: keeping everything > keeping the matmul outputs
    > keeping only layer inputs (the memory plan's ordering, runtime/memory_plan.py)."""
    model = _model(scan=True)
    batch = _batch(b=2, t=256)
    temp = {}
    for level in LEVELS:
        fn, args = _loss_and_grad(model, level, batch)
        analysis = fn.lower(*args).compile().memory_analysis()
        assert analysis is not None
        temp[level] = analysis.temp_size_in_bytes
    assert temp[Remat.NONE] > temp[Remat.DOTS] > temp[Remat.FULL], temp
