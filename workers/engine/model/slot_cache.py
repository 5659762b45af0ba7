"""What the sampler's decode slots keep per model, asked of the model's family: every layer's keys and values
(`kv_cache.LayerCache`) for a family whose layers all cache "kv", or the family's own cache for one with recurrent
layers (`Family.state_cache`, e.g. families/qwen3_5/cache.py: `empty_cache(config, slots, length, dtype)` and
`state_bytes_per_slot(config)`); its cache answers what the sampler asks of any cache: `k`/`v` (the full-attention
layers' [La, slots, S, kv_heads, head_dim]), `through(rows, lengths, fresh)` (a row view for an admission) and the
view's `settled()`.

The prefix cache's pool (sampling/prefix_cache.py) is keys and values in blocks, and for such a family also state
snapshots: `empty_pool(config, blocks, block, states, dtype)` makes it, `cache.resumed(pool, rows, resume)` sets slots'
states from snapshots and `pool.with_snapshots(cache, rows, snap)` takes them."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from .families import ModelConfig, StateCache, family_named
from .kv_cache import LayerCache, empty_cache


def recurrent(config: ModelConfig) -> bool:
    """Some layer keeps a fixed-size recurrent state rather than keys and values."""
    return "recurrent" in family_named(config.arch).cache_kinds(config)


def kv_layers(config: ModelConfig) -> int:
    """The layers whose keys and values are cached."""
    return family_named(config.arch).cache_kinds(config).count("kv")


def _family_cache(config: ModelConfig) -> StateCache:
    cache = family_named(config.arch).state_cache
    if cache is None:
        raise TypeError(f"{config.arch} has recurrent layers but no Family.state_cache for the sampler's slots")
    return cache


def empty_slot_cache(config: ModelConfig, slots: int, length: int, dtype: Any) -> Any:
    """Zero caches for `slots` slots of `length` positions, keys/values in `dtype` (the compute dtype)."""
    if recurrent(config):
        return _family_cache(config).empty_cache(config, slots, length, dtype)
    return empty_cache(config, slots, length, dtype)


def empty_prefix_pool(config: ModelConfig, blocks: int, block: int, states: int, dtype: Any) -> Any:
    """The prefix cache's pool: `blocks` blocks of `block` tokens of every cached layer's keys and values in
    `dtype`, and a recurrent model's `states` state snapshots."""
    if recurrent(config):
        return _family_cache(config).empty_pool(config, blocks, block, states, dtype)
    shape = (kv_layers(config), blocks, block, config.num_kv_heads, config.head_dim)
    return LayerCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def state_bytes_per_slot(config: ModelConfig) -> int:
    """One slot's recurrent state, whatever its length (0 for a model of keys and values only)."""
    return _family_cache(config).state_bytes_per_slot(config) if recurrent(config) else 0
