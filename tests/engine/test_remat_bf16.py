"""The checkpointing levels on bf16 weights (model/remat.py), and the residual stream kept in the compute dtype
(decoder.CausalLM's `compute_dtype_residual`, off by default), against the same model's float32 weights.

Measured on this tiny model (2 layers, one batch of 2 x 32 tokens; relative L2 of each LoRA gradient):
* bf16 weights, float32 residual: DOTS equals NONE bit for bit (the saved values are the very ones NONE keeps, the
  recomputed elementwise work is the same operations); FULL within 9.4e-8 (its recomputed bf16 GEMMs are the same
  operations on the same inputs, XLA may fuse the float32 sums after them in another order): BF16_LEVEL_TOL.
* the residual in bf16 instead: the gradients' distance to the float32-weight model's moves from 1.08e-2 to 1.06e-2
  (scan) and from 3.10e-2 to 3.16e-2 (per-layer loop): the bf16 weights' own error dominates, one rounding of the
  residual per layer adds nothing visible at 2 layers. A 36-layer model rounds it 36 times, which this cannot
  show, hence the option stays off until a device run measures it (benchmarks/device_check.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_remat_levels import LEVELS, _batch, _grads, _model, _rel

from tinkerflow.workers.engine.model.remat import Remat

BF16_LEVEL_TOL = 1e-6  # measured 9.4e-8 (FULL), 0 (DOTS): see the module doc
# The bf16-residual model's distance to float32 over the float32-residual model's: measured 0.98 and 1.02.
RESIDUAL_ERROR_RATIO = 1.1


def _max_rel(grads: dict, ref: dict) -> float:
    return max(_rel(grads[p], ref[p]) for p in ref)


# bf16 on CPU compiles and runs slowly (about 25 s a case on 2 cores): the default suite takes one case of each
# matrix, the slow mark the rest (`bash scripts/test.sh -m slow`).
@pytest.mark.parametrize(
    ("scan", "residual"),
    [
        (True, False),
        pytest.param(True, True, marks=pytest.mark.slow),
        pytest.param(False, False, marks=pytest.mark.slow),
        (False, True),
    ],
    ids=["scan-f32_residual", "scan-bf16_residual", "loop-f32_residual", "loop-bf16_residual"],
)
def test_levels_agree_on_bf16_weights(scan, residual):
    model, batch = _model(scan=scan, dtype=jnp.bfloat16), _batch()
    model.compute_dtype_residual = residual
    loss, grads = _grads(model, Remat.NONE, batch)
    dots_loss, dots = _grads(model, Remat.DOTS, batch)
    assert dots_loss == loss and _max_rel(dots, grads) == 0.0
    full_loss, full = _grads(model, Remat.FULL, batch)
    assert abs(full_loss - loss) <= BF16_LEVEL_TOL * abs(loss) and _max_rel(full, grads) <= BF16_LEVEL_TOL


@pytest.mark.parametrize("scan", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["scan", "loop"])
def test_a_bf16_residual_stream_adds_no_visible_error_on_a_shallow_model(scan):
    batch = _batch()
    _, ref = _grads(_model(scan=scan), Remat.NONE, batch)  # the same weights in float32
    model = _model(scan=scan, dtype=jnp.bfloat16)
    _, wide = _grads(model, Remat.NONE, batch)
    model.compute_dtype_residual = True
    _, narrow = _grads(model, Remat.NONE, batch)
    assert _max_rel(narrow, wide) > 0  # it is on: the stream was rounded
    assert _max_rel(narrow, ref) <= RESIDUAL_ERROR_RATIO * _max_rel(wide, ref)


def test_the_residual_option_changes_nothing_on_float32_weights():
    model, batch = _model(scan=True), _batch()
    loss, grads = _grads(model, Remat.DOTS, batch)
    model.compute_dtype_residual = True
    same_loss, same = _grads(model, Remat.DOTS, batch)
    assert same_loss == loss and all(np.array_equal(same[p], g) for p, g in grads.items())


def test_levels_cover_the_enum():
    assert set(LEVELS) == set(Remat)
