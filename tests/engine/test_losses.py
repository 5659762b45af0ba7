"""Each loss against a hand computation in numpy on a small case (sums over tokens; Tinker's scale)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tinkerflow.workers.engine.losses import LOSS_ID, LossInputs, token_losses

LP = np.array([[-0.5, -1.0, -2.0, -0.1]], np.float32)  # target log-probs, one row of 4 tokens
OLD = np.array([[-0.7, -0.9, -1.0, -0.1]], np.float32)  # sampler log-probs
ADV = np.array([[1.0, -2.0, 0.5, 3.0]], np.float32)
W = np.array([[1.0, 0.0, -0.5, 2.0]], np.float32)


def run(name: str, *, lo=0.0, hi=0.0, beta=0.0, mask=(1, 1, 1, 0)):
    inp = LossInputs(
        loss_id=jnp.array([LOSS_ID[name]]), weights=jnp.asarray(W[..., None]), mask=jnp.array([mask], jnp.float32),
        sampler_logprobs=jnp.asarray(OLD), advantages=jnp.asarray(ADV), clip_low=jnp.array([lo]),
        clip_high=jnp.array([hi]), beta=jnp.array([beta]),
    )  # fmt: skip
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
