"""The sampler's keys and values of a decoder whose every layer attends to all earlier tokens: one `LayerCache` of
[L, B, S, kv_heads, head_dim] arrays for every layer and cache slot, and `RowCache`, a few of its slots seen as a
call's batch rows (decoder.Attention reads and writes them)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .families import ModelConfig


class LayerCache(NamedTuple):
    """Keys/values of every layer for every cache slot: [L, B, S, num_kv_heads, head_dim]."""

    k: jax.Array
    v: jax.Array

    def through(self, rows: jax.Array, lengths: jax.Array, fresh: jax.Array) -> RowCache:
        """The slots `rows` as a call's batch rows. Keys and values need neither how many of the call's tokens are
        real (a padded tail's keys lie past the row's position: masked, then overwritten) nor which rows start
        afresh (a previous occupant's keys past the row's position are never read); a recurrent cache does."""
        del lengths, fresh
        return RowCache(self.k, self.v, rows)


class RowCache(NamedTuple):
    """A `LayerCache` of many slots seen through `rows` (int32 [R]): batch row r of a call reads and writes slot
    rows[r] in place, so a chunk of a few rows' prompts continues them in the shared decode cache without a copy of
    their caches. A row index past the cache (a padding row) reads zeros and writes nothing."""

    k: jax.Array
    v: jax.Array
    rows: jax.Array

    def settled(self) -> LayerCache:
        return LayerCache(self.k, self.v)


def empty_cache(config: ModelConfig, batch: int, length: int, dtype=jnp.float32, sharding=None) -> LayerCache:
    """Zero keys/values; `dtype` is the model's compute dtype (its param_dtype), in which attention reads them."""
    shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
    return LayerCache(jnp.zeros(shape, dtype, device=sharding), jnp.zeros(shape, dtype, device=sharding))
