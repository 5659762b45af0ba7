"""The blockwise (flash-style) attention: memory linear in length on every backend, the engine's portable path.

An online softmax over key blocks, one query block at a time, with a custom VJP whose backward (FlashAttention-2's)
recomputes each tile's probabilities from the saved log-sum-exp instead of storing them: O(T * D + block_q * block_k)
memory per row and head. Only the tiles some query can see are visited: the causal half, and for packed rows the
blocks of a query's own segments (attention.py says what a segment is).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .remat import ATTENTION, checkpoint_name

# Query/key block sizes: a [block_q, block_k] float32 tile per (row, head) is live at a time.
BLOCK_Q = 256
BLOCK_K = 256


def visible(q_seg: jax.Array, kv_seg: jax.Array, q_index: jax.Array, k_index: jax.Array) -> jax.Array:
    """[B, Tq, Tk]: same non-padding segment, key at or before the query."""
    same = (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] > 0)
    return same & (k_index[None, None, :] <= q_index[None, :, None])


def blockwise_attention(
    q, k, v, q_segments, kv_segments, *, q_offset: int = 0, block_q: int = BLOCK_Q, block_k: int = BLOCK_K
) -> jax.Array:
    """Flash-style attention (module docstring): float32 [B, T, H, D]."""
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    bq, bk = min(block_q, t), min(block_k, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    qg = pad(q.reshape(b, t, kvh, h // kvh, d), tp)
    out: jax.Array = _flash(qg, pad(k, sp), pad(v, sp), pad(q_segments, tp), pad(kv_segments, sp), q_offset, bq, bk)  # pyright: ignore[reportAssignmentType]  (custom_vjp's return type is opaque)
    return out[:, :t].reshape(b, t, h, d)


def pad(x: jax.Array, length: int) -> jax.Array:
    extra = length - x.shape[1]
    if extra == 0:
        return x
    return jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))  # zeros: segment 0 is padding


def _block_ranges(qs, ks, q_offset: int, bq: int, bk: int):
    """Which key blocks each query block must visit and which query blocks each key block, as inclusive ranges:
    (first_key[nq], last_key[nq], first_query[nk], last_query[nk]) int32. A tile is visited when, in some row, a
    query of the block could see a key of the block: at or before it (causal) and of the same segment. Segment ids
    rise along a row (padding 0 only at its end), so each block spans an interval of segments and the visible key
    blocks of a query block are contiguous; for packed short datums a query block visits one or two key blocks
    instead of every block up to the diagonal."""
    b = qs.shape[0]
    nq, nk = qs.shape[1] // bq, ks.shape[1] // bk
    big = jnp.iinfo(jnp.int32).max
    qb, kb = qs.reshape(b, nq, bq), ks.reshape(b, nk, bk)
    q_lo = jnp.min(jnp.where(qb > 0, qb, big), axis=-1)[:, :, None]  # [B, nq, 1]; big: no real query
    q_hi = jnp.max(qb, axis=-1)[:, :, None]
    k_lo = jnp.min(jnp.where(kb > 0, kb, big), axis=-1)[:, None, :]  # [B, 1, nk]
    k_hi = jnp.max(kb, axis=-1)[:, None, :]
    i, j = jnp.arange(nq)[:, None], jnp.arange(nk)[None, :]
    causal = j * bk <= i * bq + bq - 1 + q_offset  # some key of block j at or before some query of block i
    visit = jnp.any((q_lo <= k_hi) & (k_lo <= q_hi), axis=0) & causal  # [nq, nk]
    first_key = jnp.argmax(visit, axis=1)
    last_key = jnp.where(jnp.any(visit, axis=1), nk - 1 - jnp.argmax(visit[:, ::-1], axis=1), -1)
    first_query = jnp.argmax(visit, axis=0)
    last_query = jnp.where(jnp.any(visit, axis=0), nq - 1 - jnp.argmax(visit[::-1], axis=0), -1)
    return first_key, last_key, first_query, last_query


def _tile(qi, kj, qs_i, ks_j, i, j, q_offset: int, bq: int, bk: int):
    """Scores [B, KV, G, bq, bk] (float32, scaled) and the visibility mask [B, 1, 1, bq, bk] of one tile."""
    d = qi.shape[-1]
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * (d**-0.5)
    q_index = i * bq + jnp.arange(bq) + q_offset
    k_index = j * bk + jnp.arange(bk)
    return scores, visible(qs_i, ks_j, q_index, k_index)[:, None, None]


def _forward(q, k, v, qs, ks, q_offset: int, bq: int, bk: int):
    """out float32 [B, T, KV, G, D] and log-sum-exp float32 [B, KV, G, T] (-inf where a query sees nothing)."""
    b, t, kvh, g, d = q.shape
    nq = t // bq
    cd = q.dtype
    first_key, last_key, _, _ = _block_ranges(qs, ks, q_offset, bq, bk)

    def query_block(i):
        qi = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, axis=1)
        qs_i = jax.lax.dynamic_slice_in_dim(qs, i * bq, bq, axis=1)

        def step(j, carry):
            m, den, acc = carry
            kj = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=1)
            vj = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=1)
            ks_j = jax.lax.dynamic_slice_in_dim(ks, j * bk, bk, axis=1)
            scores, mask = _tile(qi, kj, qs_i, ks_j, i, j, q_offset, bq, bk)
            scores = jnp.where(mask, scores, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            p = jnp.exp(scores - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            den = alpha * den + jnp.sum(p, axis=-1)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(cd), vj, preferred_element_type=jnp.float32)
            return m_new, den, alpha[..., None] * acc + pv

        init = (
            jnp.full((b, kvh, g, bq), -jnp.inf, jnp.float32),
            jnp.zeros((b, kvh, g, bq), jnp.float32),
            jnp.zeros((b, kvh, g, bq, d), jnp.float32),
        )
        m, den, acc = jax.lax.fori_loop(first_key[i], last_key[i] + 1, step, init)
        seen = den > 0
        out = jnp.where(seen[..., None], acc / jnp.where(seen, den, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, den, 1.0)), -jnp.inf)
        return jnp.moveaxis(out, 3, 1), lse  # [B, bq, KV, G, D], [B, KV, G, bq]

    outs, lses = jax.lax.map(query_block, jnp.arange(nq))  # [nq, B, bq, ...], [nq, B, KV, G, bq]
    out = jnp.moveaxis(outs, 0, 1).reshape(b, t, kvh, g, d)
    lse = jnp.moveaxis(lses, 0, 3).reshape(b, kvh, g, t)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _flash(q, k, v, qs, ks, q_offset: int, bq: int, bk: int):
    return _forward(q, k, v, qs, ks, q_offset, bq, bk)[0]


def _flash_fwd(q, k, v, qs, ks, q_offset: int, bq: int, bk: int):
    out, lse = _forward(q, k, v, qs, ks, q_offset, bq, bk)
    # Named so Remat.DOTS keeps them (remat.py): the backward then recomputes q, k, v (elementwise from the saved
    # projections) but not this forward.
    out, lse = checkpoint_name(out, ATTENTION), checkpoint_name(lse, ATTENTION)
    return out, (q, k, v, qs, ks, out, lse)


def _flash_bwd(q_offset: int, bq: int, bk: int, residuals, dout):
    """FlashAttention-2's backward: per key block, over the query blocks that see it, recompute the tile's
    probabilities from the saved log-sum-exp; dK/dV accumulate per key block, dQ in one [B, T, ...] buffer."""
    q, k, v, qs, ks, out, lse = residuals
    b, _, kvh, _, d = q.shape
    nk = k.shape[1] // bk
    cd = q.dtype
    scale = d**-0.5
    _, _, first_query, last_query = _block_ranges(qs, ks, q_offset, bq, bk)
    dout = dout.astype(jnp.float32)
    delta = jnp.moveaxis(jnp.sum(dout * out, axis=-1), 1, 3)  # [B, KV, G, T]
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)  # queries that see nothing: every p below is masked to 0
    do_c = dout.astype(cd)

    def key_block(dq, j):
        kj = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=1)
        vj = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=1)
        ks_j = jax.lax.dynamic_slice_in_dim(ks, j * bk, bk, axis=1)

        def step(i, carry):
            dk, dv, dq = carry
            qi = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, axis=1)
            qs_i = jax.lax.dynamic_slice_in_dim(qs, i * bq, bq, axis=1)
            do_i = jax.lax.dynamic_slice_in_dim(do_c, i * bq, bq, axis=1)
            lse_i = jax.lax.dynamic_slice_in_dim(lse, i * bq, bq, axis=3)
            delta_i = jax.lax.dynamic_slice_in_dim(delta, i * bq, bq, axis=3)
            scores, mask = _tile(qi, kj, qs_i, ks_j, i, j, q_offset, bq, bk)
            p = jnp.where(mask, jnp.exp(scores - lse_i[..., None]), 0.0)
            dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(cd), do_i, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", do_i, vj, preferred_element_type=jnp.float32)
            ds = (p * (dp - delta_i[..., None])).astype(cd)
            dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qi, preferred_element_type=jnp.float32) * scale
            dq_i = jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=jnp.float32) * scale
            dq = jax.lax.dynamic_update_slice_in_dim(
                dq, jax.lax.dynamic_slice_in_dim(dq, i * bq, bq, axis=1) + dq_i, i * bq, axis=1
            )
            return dk, dv, dq

        zeros = jnp.zeros((b, bk, kvh, d), jnp.float32)
        dk, dv, dq = jax.lax.fori_loop(first_query[j], last_query[j] + 1, step, (zeros, zeros, dq))
        return dq, (dk, dv)

    dq, (dks, dvs) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(nk))
    dk = jnp.moveaxis(dks, 0, 1).reshape(k.shape)
    dv = jnp.moveaxis(dvs, 0, 1).reshape(v.shape)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
