"""Attention against a KV cache: one token per row decoding, or a prompt's suffix after its cached prefix. Both read
only the key blocks the rows have filled (a loop over blocks up to the furthest position, with an online softmax),
so a step's work follows what the rows hold, not the cache's length. `write_kv` and `attend_cached` are how a model's
attention layer uses them (decoder.py's and the hybrid families' alike)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def decode_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, positions: jax.Array, block: int = 512
) -> jax.Array:
    """One query token per row (q [B, 1, H, D]) against cache[layer] (k/v caches [L, B, S, KV, D]), reading only
    the key blocks up to the longest row's position (`positions` [B]: the query's index): a while loop over blocks
    with an online softmax, so a step's work follows what the rows have filled, not the cache's length. Float32
    [B, 1, H * D].

    Within a block the scores are a broadcast multiply and reductions in float32 on CPU (several times faster there
    than [1 x D] @ [D x block] batched matmuls, with the same result up to float32 rounding), batched matmuls in the
    cache's dtype with float32 accumulation on accelerators. Cache entries past a row's
    position hold a previous occupant's values (perhaps another tenant's NaN): they are selected out, never
    multiplied by a zero probability (0 * NaN is NaN)."""
    b, _, h, d = q.shape
    s, kvh = k_cache.shape[2], k_cache.shape[3]
    g = h // kvh
    blk = math.gcd(s, block)
    qf = q.reshape(b, kvh, g, d).astype(jnp.float32)

    cd = k_cache.dtype
    qc = q.reshape(b, kvh, g, d).astype(cd)
    matmuls = jax.default_backend() != "cpu"  # on accelerators the products are matmuls, on CPU broadcasts

    def step(j, carry):
        m, den, acc = carry
        start = (layer, 0, j * blk, 0, 0)
        kj = jax.lax.dynamic_slice(k_cache, start, (1, b, blk, kvh, d))[0]
        vj = jax.lax.dynamic_slice(v_cache, start, (1, b, blk, kvh, d))[0]
        visible = (j * blk + jnp.arange(blk))[None, :] <= positions[:, None]  # [B, blk]
        if matmuls:
            scores = jnp.einsum("bkgd,bskd->bskg", qc, kj, preferred_element_type=jnp.float32) * (d**-0.5)
        else:
            scores = jnp.sum(qf[:, None] * kj.astype(jnp.float32)[:, :, :, None, :], axis=-1) * (d**-0.5)
        scores = jnp.where(visible[:, :, None, None], scores, -jnp.inf)  # [B, blk, KV, G]
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(scores - m_safe[:, None])
        alpha = jnp.exp(m - m_safe)
        vj = jnp.where(visible[:, :, None, None], vj, jnp.zeros((), vj.dtype))
        if matmuls:
            pv = jnp.einsum("bskg,bskd->bkgd", p.astype(cd), vj, preferred_element_type=jnp.float32)
        else:
            pv = jnp.sum(p[..., None] * vj.astype(jnp.float32)[:, :, :, None, :], axis=1)  # [B, KV, G, D]
        return m_new, alpha * den + jnp.sum(p, axis=1), alpha[..., None] * acc + pv

    init = (
        jnp.full((b, kvh, g), -jnp.inf, jnp.float32),
        jnp.zeros((b, kvh, g), jnp.float32),
        jnp.zeros((b, kvh, g, d), jnp.float32),
    )
    if s == blk:  # one block: no loop (on a GPU a loop costs a host round trip per layer and step)
        _, den, acc = step(0, init)
    else:
        blocks = jnp.minimum(s // blk, jnp.max(positions) // blk + 1)
        _, den, acc = jax.lax.fori_loop(0, blocks, step, init)
    out = acc / jnp.where(den > 0, den, 1.0)[..., None]
    return out.reshape(b, 1, h * d)


def suffix_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer,
    positions: jax.Array,
    block: int = 256,
    rows: jax.Array | None = None,
) -> jax.Array:
    """Several query tokens per row (q [B, T, H, D], at `positions` [B, T]) continuing rows whose earlier keys and
    values are in cache[layer] (k/v caches [L, N, S, KV, D]; row b is cache row `rows[b]`, or b when `rows` is
    None): a prompt's suffix after its cached prefix, or one chunk of a prompt prefilled in chunks. A query at
    position p sees the cache entries 0..p (its own key included, written before the call). Like `decode_attention`,
    a loop over key blocks up to the furthest position with an online softmax; entries past a row's furthest query are
    selected out. Float32 [B, T, H * D]."""
    b, t, h, d = q.shape
    s, kvh = k_cache.shape[2], k_cache.shape[3]
    g = h // kvh
    blk = math.gcd(s, block)
    cd = k_cache.dtype
    qc = q.reshape(b, t, kvh, g, d).astype(cd)
    furthest = jnp.max(positions, axis=1)  # [B]

    def read(cache: jax.Array, j) -> jax.Array:  # key or value block j of every row: [B, blk, KV, D]
        if rows is None:
            return jax.lax.dynamic_slice(cache, (layer, 0, j * blk, 0, 0), (1, b, blk, kvh, d))[0]
        cols = j * blk + jnp.arange(blk)
        return cache.at[layer, rows[:, None], cols[None, :]].get(mode="fill", fill_value=0)

    def step(j, carry):
        m, den, acc = carry  # [B, T, KV, G], [B, T, KV, G], [B, T, KV, G, D]
        kj, vj = read(k_cache, j), read(v_cache, j)
        index = j * blk + jnp.arange(blk)
        visible = index[None, None, :] <= positions[:, :, None]  # [B, T, blk]
        scores = jnp.einsum("btkgd,bskd->btkgs", qc, kj, preferred_element_type=jnp.float32) * (d**-0.5)
        scores = jnp.where(visible[:, :, None, None, :], scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(scores - m_safe[..., None])
        alpha = jnp.exp(m - m_safe)
        vj = jnp.where((index[None, :] <= furthest[:, None])[:, :, None, None], vj, jnp.zeros((), vj.dtype))
        pv = jnp.einsum("btkgs,bskd->btkgd", p.astype(cd), vj, preferred_element_type=jnp.float32)
        return m_new, alpha * den + jnp.sum(p, axis=-1), alpha[..., None] * acc + pv

    init = (
        jnp.full((b, t, kvh, g), -jnp.inf, jnp.float32),
        jnp.zeros((b, t, kvh, g), jnp.float32),
        jnp.zeros((b, t, kvh, g, d), jnp.float32),
    )
    blocks = jnp.minimum(s // blk, jnp.max(positions) // blk + 1)
    _, den, acc = jax.lax.fori_loop(0, blocks, step, init)
    out = acc / jnp.where(den > 0, den, 1.0)[..., None]
    return out.reshape(b, t, h * d)


def write_kv(
    k: jax.Array,
    v: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer,
    positions: jax.Array,
    rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """k/v [B, T, KV, D] written at cache[layer, row, positions] (row b is cache row `rows[b]`, or b). Each row
    writes at its own positions, so rows of different lengths share one cache: entries past a row's position are
    masked when read and overwritten before they become visible; positions past the cache's end (a chunk's
    padding) and rows past it (padding rows) write nothing."""
    at = (jnp.arange(k.shape[0]) if rows is None else rows)[:, None]
    return k_cache.at[layer, at, positions].set(k, mode="drop"), v_cache.at[layer, at, positions].set(v, mode="drop")


def attend_cached(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, positions: jax.Array, rows: jax.Array | None = None
) -> jax.Array:
    """q [B, T, H, D] at `positions` [B, T] against cache[layer], its own keys already written: one token per row of
    the whole cache decodes (`decode_attention`); anything else continues the rows' cached keys
    (`suffix_attention`). Float32 [B, T, H * D]."""
    if q.shape[1] == 1 and rows is None:
        return decode_attention(q, k_cache, v_cache, layer, positions[:, 0])
    return suffix_attention(q, k_cache, v_cache, layer, positions, rows=rows)
