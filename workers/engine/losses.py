"""Tinker's loss functions as per-token terms; every loss is a SUM over tokens and datums (Tinker's scale).

A batch may mix losses (one per request), so each row carries a loss id and its config; all losses are cheap
elementwise maps of the target log-probs, computed for every row and selected per row. The unselected branches get
exactly zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

LOSS_NAMES: tuple[str, ...] = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro")
LOSS_ID = {name: i for i, name in enumerate(LOSS_NAMES)}

# loss_fn_config keys each loss accepts, with their defaults.
LOSS_CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
}

# loss_fn_inputs each loss requires (target_tokens always) and accepts.
LOSS_REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
}
LOSS_OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {"cross_entropy": ("weights",)}


@jax.tree_util.register_dataclass
@dataclass
class LossInputs:
    """Per-row loss selection and per-token inputs, padded to the batch bucket (padding has mask/weights 0)."""

    loss_id: jax.Array  # int32 [B]
    weights: jax.Array  # float32 [B, T, K]  (cross_entropy; K > 1 for top-K distillation targets)
    mask: jax.Array  # float32 [B, T]     1 on real positions
    sampler_logprobs: jax.Array  # float32 [B, T]
    advantages: jax.Array  # float32 [B, T]
    clip_low: jax.Array  # float32 [B]
    clip_high: jax.Array  # float32 [B]
    beta: jax.Array  # float32 [B]


def token_losses(target_lp: jax.Array, inp: LossInputs) -> jax.Array:
    """Per-token loss [B, T] for target log-probs [B, T, K]; the datum's loss is the sum over its tokens."""
    cross_entropy = -jnp.sum(target_lp * inp.weights, axis=-1)

    lp = target_lp[..., 0]
    adv = inp.advantages
    ratio = jnp.exp(lp - inp.sampler_logprobs)
    lo, hi = inp.clip_low[:, None], inp.clip_high[:, None]
    importance_sampling = -ratio * adv
    ppo = -jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
    cispo = -jax.lax.stop_gradient(jnp.clip(ratio, lo, hi)) * lp * adv
    dro = -(lp * adv - 0.5 * inp.beta[:, None] * jnp.square(lp - inp.sampler_logprobs))

    per_loss = jnp.stack([cross_entropy, importance_sampling, ppo, cispo, dro])  # [L, B, T]
    chosen = jnp.take_along_axis(per_loss, inp.loss_id[None, :, None], axis=0)[0]
    return chosen * inp.mask
