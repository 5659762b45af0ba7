"""Dimuon on one adapter slot: momentum, then a preconditioned matrix sign per LoRA matrix.

Tinker offers Dimuon beside AdamW, chosen when the training client is created; its public description names the
parts (DimuonParams: a learning rate applied to a direction of Frobenius norm sqrt(rank) with a rank correction
applied uniformly to every LoRA matrix, grad_clip_norm, beta1, a damping that smooths the row and column
preconditioners, a matrix-sign iteration whose iteration count and normalization epsilon are internal constants).
The formula is not published; this is tinkerflow's, built from those parts (docs/optimizers.md states it too):

    g  = clip(masked gradient, grad_clip_norm)              torch's clip_grad_norm_ over the slot's whole tree
    m  = beta1 * m + (1 - beta1) * g                          the momentum (the slot's `mu`; `nu` stays zero)
    for every LoRA matrix M of m, viewed as [k, r] (A: [in, rank]; B: [rank, out] transposed, so the rank axis
    is last; stacked layers and MoE experts are matrices each):
        rho_i   = sum_j M_ij^2 / (|M|_F^2 / k)                row energies over their mean
        gamma_j = sum_i M_ij^2 / (|M|_F^2 / rank)             column energies over their mean (live columns)
        P = diag(rho + damping)^(-1/4),  Q = diag(gamma + damping)^(-1/4)
        S = sign(P M Q)          the polar factor, by NS_STEPS Newton-Schulz steps X <- 1.5 X - 0.5 X (X^T X)
                                 from X = P M Q / |P M Q|_F
        D = P S Q,  scaled to |D|_F = sqrt(rank)
    W <- W - learning_rate * (rank / 32) ** rank_lr_correction_exponent * D

P S Q is the steepest-descent direction for the spectral norm of P^-1 D Q^-1: with a large damping P and Q tend
to a constant and D to Muon's sign(M); with a small one, rows and columns of large energy take proportionally
smaller steps. Damping is relative to the mean energy, so the step does not depend on the gradient's scale. The
rank correction's default exponent 0.5 keeps the Frobenius norm of the first update of the product B A (scale
alpha / rank) the same at every rank, so one learning rate serves all ranks; 0 switches it off.

Like AdamW's step (optimizer.py), the step reads one slot's slice and returns its new values; `write_slot_values`
writes them in place. Hyper-parameters, rank and trained groups are traced: one compile.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..model.lora import is_a_leaf
from .optimizer import OptState, SlotShape, clip_by_global_norm_torch, slot_masks, take_slot

NS_STEPS = 12  # Newton-Schulz steps: a singular value at 1/100 of the largest reaches ~1 (1.5^12 ~ 130)
NORM_EPS = 1e-30  # floor of the norms the iteration divides by: an all-zero matrix gives a zero direction
RANK_CORRECTION_BASE = 32.0  # the rank at which the rank correction is 1


def pack_dimuon(values: tuple[float, ...], rank: int, trained: tuple[bool, bool, bool]) -> np.ndarray:
    """(lr, beta1, grad_clip_norm, damping, rank_lr_correction_exponent), the rank and the trained flags as one
    float32 vector."""
    return np.asarray([*values, rank, *trained], np.float32)


def _fro(x: jax.Array) -> jax.Array:
    return jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True))


def matrix_sign(x: jax.Array) -> jax.Array:
    """The polar factor of each [..., k, r] matrix (r the small side), by Newton-Schulz from the Frobenius-normalised
    matrix (every singular value then in (0, 1], inside the iteration's basin (0, sqrt 3)); zero stays zero."""
    x = x / jnp.maximum(_fro(x), NORM_EPS)
    for _ in range(NS_STEPS):
        x = 1.5 * x - 0.5 * x @ (jnp.swapaxes(x, -1, -2) @ x)
    return x


def direction(m: jax.Array, rank: jax.Array, damping: jax.Array) -> jax.Array:
    """The Dimuon direction of each [..., k, r] momentum matrix (rank axis last): P sign(P M Q) Q with Frobenius
    norm sqrt(rank) (see the module doc)."""
    sq = m * m
    total = jnp.sum(sq, axis=(-2, -1), keepdims=True)
    live = total > 0
    safe = jnp.where(live, total, 1.0)
    rows = jnp.where(live, jnp.sum(sq, axis=-1, keepdims=True) * (m.shape[-2] / safe), 0.0)
    cols = jnp.where(live, jnp.sum(sq, axis=-2, keepdims=True) * (rank / safe), 0.0)
    p, q = (rows + damping) ** -0.25, (cols + damping) ** -0.25
    d = p * matrix_sign(p * m * q) * q
    return d * (jnp.sqrt(rank) / jnp.maximum(_fro(d), NORM_EPS))


def dimuon_slot_math(params: Any, g: Any, mu: Any, count: jax.Array, packed: jax.Array):
    """One Dimuon step on one slot's slices; returns (params, momentum, count, grad_norm before clipping)."""
    lr, beta1, clip, damping, exponent = (packed[i] for i in range(5))
    shape = SlotShape(rank=packed[5].astype(jnp.int32), trained=packed[6:9])
    rank = packed[5]
    masks = slot_masks(params, shape)
    g = jax.tree.map(jnp.multiply, g, masks)
    g, grad_norm = clip_by_global_norm_torch(g, clip)
    mu = jax.tree.map(lambda m, gg, k: (beta1 * m + (1.0 - beta1) * gg) * k, mu, g, masks)
    step = lr * (rank / RANK_CORRECTION_BASE) ** exponent

    def update(path, w, m, keep):
        if is_a_leaf(path):  # A [..., in, R]: the rank axis is already last
            d = direction(m, rank, damping)
        else:  # B [..., R, out]: transposed, so the small rank axis is the one the iteration squares
            d = jnp.swapaxes(direction(jnp.swapaxes(m, -1, -2), rank, damping), -1, -2)
        return (w - step * d) * keep

    params = jax.tree_util.tree_map_with_path(update, params, mu, masks)
    return params, mu, count + 1, grad_norm


@jax.jit
def dimuon_slot_values(lora: Any, grads: Any, opt: OptState, slot: jax.Array, packed: jax.Array):
    """Read-only half of a Dimuon step, shaped like optimizer.adamw_slot_values: `slot`'s new weights, momentum and
    (unchanged, zero) nu as flat leaf lists, its new step count, and metrics float32 [grad_norm before clipping,
    step, 1.0 if the new weights and momentum are all finite]. `packed` comes from pack_dimuon."""
    take = lambda tree: jax.tree.map(lambda x: take_slot(x, slot), tree)  # noqa: E731
    params, mu, count, grad_norm = dimuon_slot_math(
        take(lora), take(grads), take(opt.mu), take_slot(opt.count, slot), packed
    )
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves((params, mu))]))
    metrics = jnp.stack([grad_norm.astype(jnp.float32), count.astype(jnp.float32), finite.astype(jnp.float32)])
    return (jax.tree.leaves(params), jax.tree.leaves(mu), jax.tree.leaves(take(opt.nu))), count, metrics
