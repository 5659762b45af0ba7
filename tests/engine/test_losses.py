"""Each loss against a hand computation in numpy on a small case (sums over tokens; Tinker's scale)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tinkerflow.workers.engine.training.losses import LOSS_ID, LossInputs, token_losses

LP = np.array([[-0.5, -1.0, -2.0, -0.1]], np.float32)  # target log-probs, one row of 4 tokens
OLD = np.array([[-0.7, -0.9, -1.0, -0.1]], np.float32)  # sampler log-probs
ADV = np.array([[1.0, -2.0, 0.5, 3.0]], np.float32)
W = np.array([[1.0, 0.0, -0.5, 2.0]], np.float32)
SEQ = np.array([[0.0, 1.0, 1.0, 1.0]], np.float32)  # gspo's sequence_ratio_mask / stable_reinforce's sampled tokens


def run(name: str, *, lo=0.0, hi=0.0, beta=0.0, mask=(1, 1, 1, 0)):
    inp = LossInputs(
        loss_id=jnp.array([LOSS_ID[name]]),
        weights=jnp.asarray(W[..., None]),
        mask=jnp.array([mask], jnp.float32),
        sampler_logprobs=jnp.asarray(OLD),
        advantages=jnp.asarray(ADV),
        clip_low=jnp.array([lo]),
        clip_high=jnp.array([hi]),
        beta=jnp.array([beta]),
        seq_mask=jnp.asarray(SEQ),
    )
    loss = lambda lp: jnp.sum(token_losses(lp[..., None], inp))  # noqa: E731
    return np.asarray(token_losses(jnp.asarray(LP)[..., None], inp)), np.asarray(jax.grad(loss)(jnp.asarray(LP)))


M = np.array([[1, 1, 1, 0]], np.float32)
R = np.exp(LP - OLD)


@pytest.mark.parametrize(
    "name,kwargs,expected",
    [
        ("cross_entropy", {}, -LP * W * M),
        ("importance_sampling", {}, -R * ADV * M),
        ("ppo", {"lo": 0.8, "hi": 1.2}, -np.minimum(R * ADV, np.clip(R, 0.8, 1.2) * ADV) * M),
        ("cispo", {"lo": 0.0, "hi": 1.1}, -np.clip(R, 0.0, 1.1) * LP * ADV * M),
        ("dro", {"beta": 0.05}, -(LP * ADV - 0.5 * 0.05 * (LP - OLD) ** 2) * M),
    ],
)
def test_loss_values(name, kwargs, expected):
    per_token, _ = run(name, **kwargs)
    np.testing.assert_allclose(per_token, expected, rtol=1e-6, atol=1e-7)


def test_cispo_gradient_stops_through_the_clipped_ratio():
    _, grad = run("cispo", lo=0.0, hi=1.1)
    np.testing.assert_allclose(grad, -np.clip(R, 0.0, 1.1) * ADV * M, rtol=1e-6)


def test_ppo_gradient_is_zero_where_clipped():
    _, grad = run("ppo", lo=0.8, hi=1.2)
    clipped = np.minimum(R * ADV, np.clip(R, 0.8, 1.2) * ADV) != R * ADV
    expected = np.where(clipped, 0.0, -R * ADV) * M
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-7)


# GSPO-token: the sequence log-ratio is the mean of (LP - OLD) over the SEQ tokens (1, 2, 3):
# ((-1.0 + 0.9) + (-2.0 + 1.0) + (-0.1 + 0.1)) / 3 = -1.1 / 3, so s = exp(-1.1/3) ~ 0.6931 on every token.
S_GSPO = np.exp(-1.1 / 3)


def test_gspo_value_and_gradient_by_hand():
    per_token, grad = run("gspo", lo=0.8, hi=1.2)
    # clip(s) = 0.8. Token 0 (A=1): min(s, 0.8) = s. Token 1 (A=-2): min(-2s, -1.6) = -1.6, clipped.
    # Token 2 (A=0.5): min(s/2, 0.4) = s/2. Token 3 is masked out of the loss.
    np.testing.assert_allclose(per_token, [[-S_GSPO, 1.6, -0.5 * S_GSPO, 0.0]], rtol=1e-6)
    # Each token's ratio has the gradient of its own log-prob (value s): d(-s_t A)/dlp_t = -s A; clipped -> 0.
    np.testing.assert_allclose(grad, [[-S_GSPO, 0.0, -0.5 * S_GSPO, 0.0]], rtol=1e-6, atol=1e-7)


def test_gspo_on_policy_is_the_policy_gradient():
    # With the sampler's own log-probs the sequence ratio is exactly 1: value -A, gradient -A per token.
    inp = LossInputs(
        loss_id=jnp.array([LOSS_ID["gspo"]]),
        weights=jnp.zeros((1, 4, 1)),
        mask=jnp.ones((1, 4)),
        sampler_logprobs=jnp.asarray(LP),
        advantages=jnp.asarray(ADV),
        clip_low=jnp.array([1 - 3e-4]),
        clip_high=jnp.array([1 + 4e-4]),
        beta=jnp.zeros((1,)),
        seq_mask=jnp.asarray(SEQ),
    )
    g = jax.grad(lambda lp: jnp.sum(token_losses(lp[..., None], inp)))(jnp.asarray(LP))
    np.testing.assert_allclose(np.asarray(g), -ADV, rtol=1e-6)


def test_stable_reinforce_value_and_gradient_by_hand():
    # r = exp(LP - OLD) = [e^0.2, e^-0.1, e^-1, 1]; trust region [0.5, 2]: token 2 (r = 0.368) is dropped.
    # Only sampled tokens (SEQ = 0,1,1,1) inside the loss mask (1,1,1,0) count: tokens 1 and 2.
    per_token, grad = run("stable_reinforce", lo=0.5, hi=2.0, beta=0.1)
    r1 = np.exp(-0.1)
    # token 1: -r1 * lp * A + kl/2 (lp - q)^2 = -r1 * (-1)(-2) + 0.05 * 0.01;  token 2: 0 + 0.05 * 1.0
    np.testing.assert_allclose(per_token, [[0.0, -2 * r1 + 0.0005, 0.05, 0.0]], rtol=1e-6, atol=1e-7)
    # gradient: -sg(r) A + kl (lp - q): token 1: 2 r1 - 0.01; token 2: -0.1 (only the KL pull)
    np.testing.assert_allclose(grad, [[0.0, 2 * r1 - 0.01, -0.1, 0.0]], rtol=1e-6, atol=1e-7)


def test_stable_reinforce_on_policy_is_reinforce():
    inp = LossInputs(
        loss_id=jnp.array([LOSS_ID["stable_reinforce"]]),
        weights=jnp.zeros((1, 4, 1)),
        mask=jnp.ones((1, 4)),
        sampler_logprobs=jnp.asarray(LP),
        advantages=jnp.asarray(ADV),
        clip_low=jnp.array([0.5]),
        clip_high=jnp.array([2.0]),
        beta=jnp.zeros((1,)),
        seq_mask=jnp.asarray(SEQ),
    )
    g = jax.grad(lambda lp: jnp.sum(token_losses(lp[..., None], inp)))(jnp.asarray(LP))
    np.testing.assert_allclose(np.asarray(g), -ADV * SEQ, rtol=1e-6)
