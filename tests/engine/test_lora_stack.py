"""The sampler's stacked LoRA routing (lora._stacked_delta, lora_embedding_delta) against the per-row gather the
training path uses, at stack sizes unrolled whole and looped (STACK_UNROLL), with a non-finite adapter in the stack
that must not reach any other row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tinkerflow.workers.engine.model.lora import (
    STACK_UNROLL,
    LoraRouting,
    StackedLoraRouting,
    lora_delta,
    lora_embedding_delta,
)

# float32 on CPU; the two paths contract in different orders.
ATOL = 1e-5


@pytest.mark.parametrize("stack", [1, STACK_UNROLL, 3 * STACK_UNROLL + 1])
def test_stacked_delta_equals_per_row_gather(stack):
    rng = np.random.default_rng(stack)
    rows, t, i, r, o, vocab = 2 * stack + 1, 3, 8, 4, 6, 11
    x = jnp.asarray(rng.normal(size=(rows, t, i)), jnp.float32)
    a = jnp.asarray(rng.normal(size=(stack, i, r)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(stack, r, o)), jnp.float32)
    e_a = jnp.asarray(rng.normal(size=(stack, o, r)), jnp.float32)  # tied unembedding: A [H, R], B [R, V]
    e_b = jnp.asarray(rng.normal(size=(stack, r, vocab)), jnp.float32)
    adapter = jnp.asarray(np.arange(rows) % stack, jnp.int32)
    scale = jnp.asarray(rng.uniform(0.5, 2.0, size=rows), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, vocab, size=(rows, t)), jnp.int32)
    gather, stacked = LoraRouting(adapter, scale), StackedLoraRouting(adapter, scale)
    np.testing.assert_allclose(lora_delta(x, a, b, stacked), lora_delta(x, a, b, gather), atol=ATOL, rtol=ATOL)
    np.testing.assert_allclose(
        lora_embedding_delta(tokens, e_a, e_b, stacked),
        lora_embedding_delta(tokens, e_a, e_b, gather),
        atol=ATOL,
        rtol=ATOL,
    )


def test_a_non_finite_adapter_stays_in_its_rows():
    stack, rows = 3 * STACK_UNROLL + 1, 8
    a = jnp.ones((stack, 4, 2), jnp.float32).at[stack - 1].set(jnp.nan)
    b = jnp.ones((stack, 2, 5), jnp.float32).at[stack - 1].set(jnp.inf)
    adapter = jnp.asarray([0, 1, stack - 1, -1, 2, stack - 1, 5, 0], jnp.int32)
    out = jax.jit(lora_delta)(jnp.ones((rows, 1, 4)), a, b, StackedLoraRouting(adapter, jnp.ones(rows)))
    finite = np.isfinite(np.asarray(out)).all(axis=(1, 2))
    assert finite.tolist() == [s != stack - 1 for s in adapter.tolist()]
    assert np.all(np.asarray(out)[3] == 0.0)  # adapter -1: the base model, no delta
