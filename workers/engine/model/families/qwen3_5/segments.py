"""Packed segment ids (`attention.Segments.ids`: 1, 2, ... per datum in order, 0 for padding) as the recurrent parts of
Qwen3.5 (the causal conv and the gated delta rule) read them: a *run* id per token that changes exactly where a new
datum starts, so "same run" means "may share state".

Padding belongs to the run before it and is a no-op there (the layer zeroes its inputs, the delta rule its update),
so a row's final state is the state after its last real token whatever padding follows, and left padding does not
start a run. A row's first real token never starts a run: a state passed into a call continues the row's first
segment (a prompt prefilled in chunks, or resumed from a snapshot); without one the carried state is zero, which is
the same as starting afresh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def runs(ids: jax.Array) -> jax.Array:
    """int32 [B, T] from segment ids [B, T]: how many segments started at or before each token (0: the first)."""
    seen = jax.lax.cummax(ids, axis=1)  # the latest real segment id at or before each token (ids only grow)
    before = jnp.concatenate([jnp.zeros_like(seen[:, :1]), seen[:, :-1]], axis=1)
    start = (ids != 0) & (before != 0) & (ids != before)
    return jnp.cumsum(start, axis=1, dtype=jnp.int32)


def real_length(ids: jax.Array) -> jax.Array:
    """int32 [B]: one past each row's last real (non-padding) token; 0 for a row of padding only."""
    index = jnp.arange(1, ids.shape[1] + 1, dtype=jnp.int32)
    return jnp.max(jnp.where(ids > 0, index, 0), axis=1)
