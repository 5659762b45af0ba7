"""Rotary positions as transformers' Llama-family models apply them: the cos/sin tables of a batch's positions
(with the family's frequencies, `ModelConfig.inv_freq`, llama3 scaling included) and their application to queries
and keys in the rotate-half layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .families import ModelConfig


def rope_tables(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin [B, T, head_dim] in transformers' rotate-half layout (frequencies repeated, not interleaved)."""
    freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(config.inv_freq())
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]
