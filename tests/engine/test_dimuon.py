"""Dimuon (training/dimuon.py) against a numpy reference of its documented update, written here from the formula in
docs/optimizers.md (float64, one LoRA matrix at a time, on the rank-trimmed named weights the engine exports), and on
the tiny model: the loss falls, its state survives export/import and a checkpoint, families do not mix.

Tolerance: the engine computes in float32 (12 Newton-Schulz steps of [k, r] matrix products) and the reference in
float64; each update is compared at 1e-5 of its tensor's largest entry (float32's epsilon is 1.2e-7; the products
over k <= 128 rows and 12 steps keep the error below 1e-6 of the scale in practice).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.engine.test_training import ce, seqs
from tinkerflow.workers.engine.model.lora import is_a_leaf
from tinkerflow.workers.engine.training.dimuon import matrix_sign
from tinkerflow.workers.engine.types import AdamConfig, DimuonConfig, InputError, LoraConfig

RTOL = 1e-5  # of each tensor's largest update entry (see the module doc)


# ---------------------------------------------------------------------------------------------- the reference


def ref_direction(m: np.ndarray, rank: int, damping: float) -> np.ndarray:
    """One matrix [k, rank] (rank axis last), as docs/optimizers.md states it."""
    m = m.astype(np.float64)
    total = float(np.sum(m * m))
    if total == 0.0:
        return np.zeros_like(m)
    rho = np.sum(m * m, axis=1) / (total / m.shape[0])
    gamma = np.sum(m * m, axis=0) / (total / rank)
    p, q = (rho + damping) ** -0.25, (gamma + damping) ** -0.25
    x = p[:, None] * m * q[None, :]
    x = x / np.linalg.norm(x)
    for _ in range(12):
        x = 1.5 * x - 0.5 * x @ (x.T @ x)
    d = p[:, None] * x * q[None, :]
    return d * np.sqrt(rank) / np.linalg.norm(d)


def ref_step(weights, grads, momentum, cfg: DimuonConfig, rank: int):
    """New (weights, momentum) of one step over named, rank-trimmed tensors: A [in, r], B [r, out]."""
    norm = np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
    coef = min(1.0, cfg.grad_clip_norm / (norm + 1e-6)) if cfg.grad_clip_norm > 0 else 1.0
    step = cfg.learning_rate * (rank / 32) ** cfg.rank_lr_correction_exponent
    new_w, new_m = {}, {}
    for name, w in weights.items():
        m = cfg.beta1 * momentum[name].astype(np.float64) + (1 - cfg.beta1) * coef * grads[name].astype(np.float64)
        d = ref_direction(m, rank, cfg.damping) if name.endswith("lora_a") else ref_direction(m.T, rank, cfg.damping).T
        new_w[name], new_m[name] = w.astype(np.float64) - step * d, m
    return new_w, new_m


def assert_close(actual: dict, desired: dict, before: dict | None = None):
    """Compare updates (actual - before vs desired - before) at RTOL of each tensor's largest update entry."""
    assert actual.keys() == desired.keys()
    for k in desired:
        base = 0.0 if before is None else before[k].astype(np.float64)
        got, want = actual[k] - base, desired[k] - base
        scale = float(np.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=0, atol=RTOL * scale + 1e-12, err_msg=k)


# ---------------------------------------------------------------------------------------------- the iteration


def test_matrix_sign_is_the_polar_factor_of_a_well_conditioned_matrix(rng):
    """Singular values within a factor 10 of each other: 12 Newton-Schulz steps reach the SVD's U V^T."""
    u, _ = np.linalg.qr(rng.normal(size=(48, 6)))
    v, _ = np.linalg.qr(rng.normal(size=(6, 6)))
    x = (u * np.linspace(0.3, 3.0, 6)) @ v.T
    np.testing.assert_allclose(np.asarray(matrix_sign(jnp.asarray(x, jnp.float32))), u @ v.T, atol=1e-5)


# ---------------------------------------------------------------------------------------------- on the engine


def dimuon_slot(engine, slot: int, rank: int, **lora) -> None:
    engine.create_adapter(slot, LoraConfig(rank=rank, seed=slot, optimizer="dimuon", **lora))


@pytest.mark.parametrize(
    "cfg",
    [
        DimuonConfig(learning_rate=0.05),
        DimuonConfig(learning_rate=0.02, grad_clip_norm=0.5, beta1=0.5, damping=0.1, rank_lr_correction_exponent=1.0),
    ],
)
def test_two_steps_match_the_reference(engine, rng, cfg):
    """Two steps (the second with momentum), one slot beside an AdamW slot that it must not touch."""
    dimuon_slot(engine, 0, 4)
    engine.create_adapter(1, LoraConfig(rank=8, seed=1))
    other = engine.adapter_weights(1)
    momentum = {k: np.zeros_like(v) for k, v in engine.adapter_weights(0).items()}
    for _ in range(2):
        engine.forward_backward([ce(0, seqs(rng, 3, 12)), ce(1, seqs(rng, 2, 12))])
        before, grads = engine.adapter_weights(0), engine.accumulated_grads(0)
        want_w, momentum = ref_step(before, grads, momentum, cfg, rank=4)
        metrics = engine.optim_step(0, cfg)
        assert_close(engine.adapter_weights(0), want_w, before)
        assert_close(engine.export_slot(0).mu, momentum)
    assert metrics["step"] == 2 and metrics["learning_rate"] == cfg.learning_rate
    for k, v in engine.adapter_weights(1).items():
        np.testing.assert_array_equal(v, other[k], err_msg=k)


def test_direction_has_frobenius_norm_sqrt_rank_per_matrix(engine, rng):
    """The documented scale: lr applies to a direction of Frobenius norm sqrt(rank) in every LoRA matrix (exponent 0:
    no rank correction). At the first step B = 0, so A has no gradient and stays; from the second every matrix moves."""
    dimuon_slot(engine, 0, 4)
    for step in range(2):
        engine.forward_backward([ce(0, seqs(rng, 2, 12))])
        before = engine.adapter_weights(0)
        engine.optim_step(0, DimuonConfig(learning_rate=1e-3, rank_lr_correction_exponent=0.0))
        for k, w in engine.adapter_weights(0).items():
            want = 0.0 if step == 0 and k.endswith("lora_a") else 2.0
            assert np.linalg.norm((w - before[k]) / 1e-3) == pytest.approx(want, rel=1e-4), k


def test_untrained_groups_and_columns_past_the_rank_stay_zero(engine, rng):
    dimuon_slot(engine, 0, 2, train_attn=False)
    engine.forward_backward([ce(0, seqs(rng, 2, 12))])
    engine.optim_step(0, DimuonConfig(learning_rate=0.05))
    for k, w in engine.adapter_weights(0).items():
        if "self_attn" in k:
            assert not np.any(w), k
    slots = engine._adapters  # the slot untrimmed: rank 2 of MAX_RANK 8
    full = slots.take_slot(slots.lora, np.int32(0))
    for path, leaf in jax.tree_util.tree_flatten_with_path(full)[0]:
        past_rank = np.asarray(leaf)[..., 2:] if is_a_leaf(path) else np.asarray(leaf)[..., 2:, :]
        assert not np.any(past_rank), path


def test_loss_falls_on_the_tiny_model(engine, rng):
    """Cross-entropy on a fixed batch over 8 steps at lr 0.05 (docs/optimizers.md's starting point for the tiny
    model): it falls at every step and by a third overall."""
    dimuon_slot(engine, 0, 8)
    batch = seqs(rng, 4, 16)
    losses = []
    for _ in range(8):
        out = engine.forward_backward([ce(0, batch)])[0]
        losses.append(out.metrics["loss:sum"])
        engine.optim_step(0, DimuonConfig(learning_rate=0.05))
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < 0.67 * losses[0], losses


def test_state_round_trips_through_export_and_import(engine, rng):
    """The momentum is the state: a slot restored from an export (with the optimizer) takes the very same next step
    as the original; restored without it, the momentum is zero."""
    dimuon_slot(engine, 0, 4)
    dimuon_slot(engine, 1, 4)
    batch = seqs(rng, 2, 12)
    engine.forward_backward([ce(0, batch)])
    engine.optim_step(0, DimuonConfig(learning_rate=0.05))
    engine.import_slot(1, engine.export_slot(0), optimizer=True)
    assert engine.export_slot(1).config.optimizer == "dimuon"
    for slot in (0, 1):
        engine.forward_backward([ce(slot, batch)])
        engine.optim_step(slot, DimuonConfig(learning_rate=0.05))
    a, b = engine.export_slot(0), engine.export_slot(1)
    for k in a.weights:
        np.testing.assert_array_equal(a.weights[k], b.weights[k], err_msg=k)
        np.testing.assert_array_equal(a.mu[k], b.mu[k], err_msg=k)
    assert a.step == b.step == 2


def test_families_do_not_mix(engine, rng):
    """The optimizer is fixed for a run's life: the other family's step, or its optimizer state, is a user error
    that changes nothing; weights alone load into either."""
    dimuon_slot(engine, 0, 4)
    engine.create_adapter(1, LoraConfig(rank=4, seed=1))
    engine.forward_backward([ce(0, seqs(rng, 1, 8)), ce(1, seqs(rng, 1, 8))])
    with pytest.raises(InputError, match=r"created with optimizer 'dimuon'.*needs DimuonParams"):
        engine.optim_step(0, AdamConfig(learning_rate=1e-3))
    with pytest.raises(InputError, match=r"created with optimizer 'adamw'.*needs AdamParams"):
        engine.optim_step(1, DimuonConfig(learning_rate=1e-3))
    with pytest.raises(InputError, match=r"holds adamw optimizer state.*created with dimuon"):
        engine.import_slot(0, engine.export_slot(1), optimizer=True)
    config = engine.import_slot(0, engine.export_slot(1), optimizer=False)
    assert config.optimizer == "dimuon" and engine.export_slot(0).config.optimizer == "dimuon"


def test_a_bad_config_is_refused(engine):
    dimuon_slot(engine, 0, 2)
    bad = {
        "learning_rate must be >= 0": DimuonConfig(-1.0),
        "damping must be > 0": DimuonConfig(1e-3, damping=0.0),
        "beta1 must be in": DimuonConfig(1e-3, beta1=1.0),
        "learning_rate must be finite": DimuonConfig(np.nan),
    }
    for message, config in bad.items():
        with pytest.raises(InputError, match=f"DimuonConfig.{message}"):
            engine.optim_step(0, config)


def test_a_training_checkpoint_keeps_the_family_and_the_momentum(engine, rng, tmp_path):
    from tinkerflow.workers.engine.model.checkpoint import read_training_state, write_training_state

    dimuon_slot(engine, 0, 4)
    engine.forward_backward([ce(0, seqs(rng, 2, 12))])
    engine.optim_step(0, DimuonConfig(learning_rate=0.05))
    state = engine.export_slot(0)
    write_training_state(state, tmp_path)
    back = read_training_state(tmp_path)
    assert back.config == state.config and back.config.optimizer == "dimuon" and back.step == 1
    for k in state.mu:
        np.testing.assert_array_equal(back.mu[k], state.mu[k], err_msg=k)
