"""Tinker's loss functions as per-token terms; every loss is a SUM over tokens and datums (Tinker's scale).

A batch may mix losses (one per request), so each row carries a loss id and its config; all losses are cheap
elementwise maps of the target log-probs, computed for every row and selected per row. The unselected branches get
exactly zero gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

LOSS_NAMES: tuple[str, ...] = (
    "cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "stable_reinforce",
)
LOSS_ID = {name: i for i, name in enumerate(LOSS_NAMES)}

# loss_fn_config keys each loss accepts, with their defaults.
LOSS_CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    # GSPO paper (Zheng et al., 2025) ranges: epsilon_low 3e-4, epsilon_high 4e-4 around a sequence ratio of 1.
    "gspo": {"clip_low_threshold": 1.0 - 3e-4, "clip_high_threshold": 1.0 + 4e-4},
    "stable_reinforce": {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0, "kl_coeff": 0.0},
}

# loss_fn_inputs each loss requires (target_tokens always) and accepts.
LOSS_REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages"),
    "stable_reinforce": ("target_tokens", "logprobs", "advantages"),
}
LOSS_OPTIONAL_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "gspo": ("sequence_ratio_mask",),
}
# Losses that need the datum's provenance (Datum.with_provenance): which target positions are sampled tokens.
LOSSES_NEEDING_PROVENANCE = ("stable_reinforce",)


@jax.tree_util.register_dataclass
@dataclass
class LossInputs:
    """Per-row loss selection and per-token inputs, padded to the batch bucket (padding has mask/weights 0)."""

    loss_id: jax.Array  # int32 [B, T] (or [B]: one per row)
    weights: jax.Array  # float32 [B, T, K]  (cross_entropy; K > 1 for top-K distillation targets)
    mask: jax.Array  # float32 [B, T]     1 on real positions
    sampler_logprobs: jax.Array  # float32 [B, T]
    advantages: jax.Array  # float32 [B, T]
    clip_low: jax.Array  # float32 [B, T] (or [B])
    clip_high: jax.Array  # float32 [B, T] (or [B])
    beta: jax.Array  # float32 [B, T] (or [B])  dro's beta; stable_reinforce's kl_coeff
    seq_mask: jax.Array  # float32 [B, T] gspo: tokens in the sequence ratio; stable_reinforce: sampled tokens
    # int32 [B, T]: which datum of a packed row each token belongs to (1, 2, ...; 0 padding); None: one per row.
    # Sequence-level quantities (gspo's ratio) are taken per datum.
    segments: jax.Array | None = None


def _per_token(x: jax.Array) -> jax.Array:
    """A per-row [B] value broadcast to [B, T]; a per-token one as it is."""
    return x[:, None] if x.ndim == 1 else x


def datum_sum(x: jax.Array, segments: jax.Array | None) -> jax.Array:
    """Each token's datum total of x [B, T]: the row's sum, or with packed segments the sum over its segment."""
    if segments is None:
        return jnp.broadcast_to(jnp.sum(x, axis=-1, keepdims=True), x.shape)
    b, t = x.shape
    ids = (jnp.arange(b)[:, None] * t + segments).reshape(-1)
    sums = jax.ops.segment_sum(x.reshape(-1), ids, num_segments=b * t + 1)
    return sums[ids].reshape(b, t)


def token_losses(target_lp: jax.Array, inp: LossInputs) -> jax.Array:
    """Per-token loss [B, T] for target log-probs [B, T, K]; the datum's loss is the sum over its tokens."""
    cross_entropy = -jnp.sum(target_lp * inp.weights, axis=-1)

    lp = target_lp[..., 0]
    adv = inp.advantages
    ratio = jnp.exp(lp - inp.sampler_logprobs)
    lo, hi, beta = (_per_token(x) for x in (inp.clip_low, inp.clip_high, inp.beta))
    importance_sampling = -ratio * adv
    ppo = -jnp.minimum(ratio * adv, jnp.clip(ratio, lo, hi) * adv)
    cispo = -jax.lax.stop_gradient(jnp.clip(ratio, lo, hi)) * lp * adv
    dro = -(lp * adv - 0.5 * beta * jnp.square(lp - inp.sampler_logprobs))
    gspo = _gspo(lp, inp, lo, hi)
    stable_reinforce = _stable_reinforce(lp, ratio, inp, lo, hi, beta)

    per_loss = jnp.stack([cross_entropy, importance_sampling, ppo, cispo, dro, gspo, stable_reinforce])  # [L, B, T]
    loss_id = jnp.broadcast_to(_per_token(inp.loss_id), lp.shape)
    chosen = jnp.take_along_axis(per_loss, loss_id[None], axis=0)[0]
    return chosen * inp.mask


def _gspo(lp: jax.Array, inp: LossInputs, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """GSPO-token (Tinker's `gspo`; Zheng et al., 2025).

    The sequence log-ratio is the mean, per datum (a packed row's segment), of sg(logp) - q over the tokens M
    that `seq_mask` marks (`sequence_ratio_mask`; without it, the tokens with a nonzero advantage, which are the
    sampled tokens of every cookbook datum). Every token's ratio takes that value with its own log-prob's gradient,
    s_t = exp(log_s + logp_t - sg(logp_t)), and enters PPO's clipped min: -min(s_t A_t, clip(s_t, lo, hi) A_t),
    summed over all tokens (Tinker's scale; tokens outside M still carry s_t with their own advantage).
    """
    sg_lp = jax.lax.stop_gradient(lp)
    m = inp.seq_mask
    total = datum_sum(m * (sg_lp - inp.sampler_logprobs), inp.segments)
    log_s = total / jnp.maximum(datum_sum(m, inp.segments), 1.0)
    s_t = jnp.exp(log_s + lp - sg_lp)
    adv = inp.advantages
    return -jnp.minimum(s_t * adv, jnp.clip(s_t, lo, hi) * adv)


def _stable_reinforce(
    lp: jax.Array, ratio: jax.Array, inp: LossInputs, lo: jax.Array, hi: jax.Array, beta: jax.Array
) -> jax.Array:
    """StableReinforce (Tinker's `stable_reinforce`, alpha; tinkerflow's definition, derived from its inputs).

    Inputs, as the SDK 0.38 types and the cookbook 0.6.1 build them: the datum's provenance spans name the sampled
    sequence behind each target position; positions in a SampledProvenanceSpan are the sampled tokens M
    (`seq_mask`); `logprobs` holds the sampler's log-probs q of those tokens, which the JAX worker takes from the
    server's stability record of the sequence (sampled with `record_stability_info=True`; activities/stability_checks.py
    checks the datum's tokens and log-probs against it first); advantages are nonzero only on M (the cookbook's rule:
    "stable_reinforce only accepts nonzero advantages on sampled tokens"; validation refuses others).

    Objective, on M only: REINFORCE with a stop-gradient importance weight and a token trust region,
        loss_t = -1[lo <= r_t <= hi] * sg(r_t) * logp_t * A_t + kl_coeff/2 * (logp_t - q_t)^2,   r_t = exp(logp_t - q_t)
    On-policy (r = 1) its gradient is plain REINFORCE, -A grad(logp). Off-policy, the weight corrects for the
    sampler (sg(r) grad(logp) = grad(r)), and a token the trained policy has moved outside [lo, hi] of the
    sampler's probability is dropped rather than clipped, so stale or numerically mismatched tokens cannot blow the
    update up (defaults lo=0.5, hi=2.0). `kl_coeff` (default 0) adds dro's quadratic pull towards the sampler.
    """
    in_region = ((ratio >= lo) & (ratio <= hi)).astype(lp.dtype)
    weight = jax.lax.stop_gradient(ratio * in_region)
    kl = 0.5 * beta * jnp.square(lp - inp.sampler_logprobs)
    return inp.seq_mask * (-weight * lp * inp.advantages + kl)
