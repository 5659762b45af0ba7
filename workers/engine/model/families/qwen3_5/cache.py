"""Qwen3.5's sampling cache: what the decode slots keep between steps for a model whose layers mix gated full
attention (keys and values of every position) with Gated DeltaNet (a fixed-size state per row).

`HybridCache` holds, for every cache slot, the full-attention layers' keys/values in the layout of
`kv_cache.LayerCache` ([La, slots, S, kv_heads, head_dim], La the full-attention layers in order, so
`cached_attention`'s kernels and the prefix cache's pool read them as they read a dense model's) and the linear
layers' states ([Ll, slots, ...], Ll the linear layers in order): the conv's last K - 1 inputs [K - 1, conv_dim]
and the delta rule's matrix [value heads, dk, dv], both float32 whatever the compute dtype (the recurrence
accumulates, as transformers keeps it). A slot's linear-layer memory is the same at any length.

`HybridRowCache` is it seen through `rows`, as `kv_cache.RowCache`: batch row r of a call reads and writes slot
rows[r] in place (a row past the cache reads zeros and writes nothing). It also says, per row, how many of the
call's tokens are real (`lengths`: an admission chunk's tail past a prompt is padding, which must not enter the
recurrent state) and which rows start afresh (`fresh`: their slot's state is a previous occupant's, read as zeros).

The prefix cache's pool (`empty_pool`, sampling/prefix_cache.py) is a `HybridCache` too, of other sizes: keys and
values in blocks ([La, blocks, BLOCK, ...]) and state snapshots ([Ll, states, ...]), a slot's states at a block
boundary: `resumed` sets slots' states from snapshots, `with_snapshots` takes slots' states as snapshots.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .config import FULL_ATTENTION, LINEAR_ATTENTION, Qwen35Config
from .linear_attention import LinearAttentionState


def layer_slots(config: Qwen35Config) -> tuple[int, ...]:
    """Per layer, its index among the layers of its kind (full attention: into k/v; linear: into the states)."""
    seen = {FULL_ATTENTION: 0, LINEAR_ATTENTION: 0}
    out = []
    for kind in config.layer_types:
        out.append(seen[kind])
        seen[kind] += 1
    return tuple(out)


def state_bytes_per_slot(config: Qwen35Config) -> int:
    """One slot's linear-layer states (conv and recurrent, float32), whatever its length."""
    c = config
    per_layer = (c.linear_conv_kernel_dim - 1) * c.conv_dim
    per_layer += c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    return 4 * per_layer * c.layer_types.count(LINEAR_ATTENTION)


class HybridCache(NamedTuple):
    """Every slot's cache: `k`, `v` [La, B, S, kv_heads, head_dim] (compute dtype), `conv` float32
    [Ll, B, K - 1, conv_dim], `recurrent` float32 [Ll, B, value heads, dk, dv]."""

    k: jax.Array
    v: jax.Array
    conv: jax.Array
    recurrent: jax.Array

    def through(self, rows: jax.Array, lengths: jax.Array, fresh: jax.Array) -> HybridRowCache:
        """The slots `rows` (int32 [R]) as batch rows, `lengths` (int32 [R]) of the call's tokens real and the
        `fresh` (bool [R]) rows starting from zero state."""
        return HybridRowCache(self.k, self.v, self.conv, self.recurrent, rows, lengths, fresh)

    def state(self, layer: int) -> LinearAttentionState:
        return LinearAttentionState(self.conv[layer], self.recurrent[layer])

    def resumed(self, pool: HybridCache, rows: jax.Array, resume: jax.Array) -> HybridCache:
        """Slots `rows` (int32 [R]) with the linear layers' states of `pool`'s snapshots `resume` (int32 [R]; past
        the pool: the slot keeps its own)."""
        at = jnp.where(resume < pool.conv.shape[1], rows, self.conv.shape[1])  # rows that resume; others nowhere

        def one(dst: jax.Array, src: jax.Array) -> jax.Array:
            return dst.at[:, at].set(src.at[:, resume].get(mode="fill", fill_value=0), mode="drop")

        return self._replace(conv=one(self.conv, pool.conv), recurrent=one(self.recurrent, pool.recurrent))

    def with_snapshots(self, cache: HybridCache, rows: jax.Array, snap: jax.Array) -> HybridCache:
        """This pool with the linear layers' states of `cache`'s slots `rows` (int32 [R]) as snapshots `snap`
        (int32 [R]; past the pool: none taken)."""

        def one(dst: jax.Array, src: jax.Array) -> jax.Array:
            return dst.at[:, snap].set(src.at[:, rows].get(mode="fill", fill_value=0), mode="drop")

        return self._replace(conv=one(self.conv, cache.conv), recurrent=one(self.recurrent, cache.recurrent))

    def with_state(self, layer: int, state: LinearAttentionState) -> HybridCache:
        return self._replace(
            conv=self.conv.at[layer].set(state.conv), recurrent=self.recurrent.at[layer].set(state.recurrent)
        )


class HybridRowCache(NamedTuple):
    """A `HybridCache` seen through `rows` (module docstring)."""

    k: jax.Array
    v: jax.Array
    conv: jax.Array
    recurrent: jax.Array
    rows: jax.Array  # int32 [R]: the slot of each batch row (past the cache: a padding row)
    lengths: jax.Array  # int32 [R]: real tokens of the call per row, from its first
    fresh: jax.Array  # bool [R]: the row's state starts at zero

    def settled(self) -> HybridCache:
        return HybridCache(self.k, self.v, self.conv, self.recurrent)

    def state(self, layer: int) -> LinearAttentionState:
        def read(x: jax.Array) -> jax.Array:
            got = x.at[layer, self.rows].get(mode="fill", fill_value=0)
            return jnp.where(self.fresh.reshape(-1, *(1,) * (got.ndim - 1)), 0.0, got)

        return LinearAttentionState(read(self.conv), read(self.recurrent))

    def with_state(self, layer: int, state: LinearAttentionState) -> HybridRowCache:
        return self._replace(
            conv=self.conv.at[layer, self.rows].set(state.conv, mode="drop"),
            recurrent=self.recurrent.at[layer, self.rows].set(state.recurrent, mode="drop"),
        )


def empty_pool(config: Qwen35Config, blocks: int, block: int, states: int, dtype=jnp.float32) -> HybridCache:
    """The prefix cache's pool: zero keys/values of `blocks` blocks of `block` tokens in `dtype`, and `states` zero
    float32 state snapshots."""
    kv, conv, rec = _shapes(config, blocks, block)
    return HybridCache(
        jnp.zeros(kv, dtype),
        jnp.zeros(kv, dtype),
        jnp.zeros((conv[0], states, *conv[2:]), jnp.float32),
        jnp.zeros((rec[0], states, *rec[2:]), jnp.float32),
    )


def _shapes(config: Qwen35Config, batch: int, length: int) -> tuple[tuple[int, ...], ...]:
    c = config
    full, linear = c.layer_types.count(FULL_ATTENTION), c.layer_types.count(LINEAR_ATTENTION)
    kv = (full, batch, length, c.num_kv_heads, c.head_dim)
    conv = (linear, batch, c.linear_conv_kernel_dim - 1, c.conv_dim)
    rec = (linear, batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
    return kv, conv, rec


def empty_cache(config: Qwen35Config, batch: int, length: int, dtype=jnp.float32, sharding=None) -> HybridCache:
    """Zero keys/values in `dtype` (the compute dtype) and zero float32 states for `batch` slots of `length`."""
    kv, conv, rec = _shapes(config, batch, length)
    return HybridCache(
        jnp.zeros(kv, dtype, device=sharding),
        jnp.zeros(kv, dtype, device=sharding),
        jnp.zeros(conv, jnp.float32),
        jnp.zeros(rec, jnp.float32),
    )
