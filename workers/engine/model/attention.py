"""Causal self-attention with memory linear in sequence length, and the materialised attention it replaces.

Every attention call here takes queries [B, T, H, D], keys/values [B, S, KV, D] (grouped-query: H = KV * G) in the
compute dtype and *segment ids* [B, T] / [B, S]: a query sees a key when both carry the same segment id (> 0; 0 is
padding) and the key's index in the row is at most the query's (`q_offset` shifts the queries' indices, for a
suffix of a row whose prefix keys are already cached). Several datums packed into one row are several segments;
a row of one datum is one segment. The result is float32 [B, T, H * D]; padding queries get exactly zero.

Implementations, chosen by `select` from the backend (TINKERFLOW_ATTENTION overrides it):

* `reference`: the [B, KV, G, T, S] float32 scores materialised, one softmax (the engine's original attention, kept
  as the reference every other path is tested against; its memory is quadratic in length).
* `blockwise`: a flash-style online softmax scanned over key blocks, one query block at a time, with a custom VJP
  whose backward recomputes each block's probabilities from the saved log-sum-exp instead of storing them. Memory is
  O(T * D + block_q * block_k) per row and head; fully masked blocks (above the causal diagonal) are skipped, so the
  work is the causal half. Runs on every backend; the fallback.
* `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` on GPU, for bf16/fp16 calls whose rows are one
  segment each (right padding only: cuDNN takes per-row lengths, not segment ids).
* `pallas_gpu`: the Pallas (Triton) flash-attention kernel shipped with jax for GPU (segment ids, causal, its own
  backward): packed rows on GPU.
* `pallas_tpu`: the Pallas flash-attention kernel shipped with jax for TPU (segment ids, causal, its own backward).

Measured on one H100 (docs/benchmarks-gpu.md), Qwen3-8B's heads, bf16, forward+backward of 32K tokens: cuDNN 44 ms,
Pallas 212 ms, blockwise 503 ms (packed) to 901 ms; so GPU takes cuDNN where it applies and Pallas for packed rows.

Dtypes: q/k/v in the compute dtype (bf16 on accelerators), scores, softmax statistics and accumulation in float32,
probabilities cast to the compute dtype for the P @ V product (as the reference does).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp

from tinkerflow.common.settings import env_setting

Implementation = Literal["reference", "blockwise", "cudnn", "pallas_gpu", "pallas_tpu"]
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "reference", "blockwise", "cudnn", "pallas_gpu", "pallas_tpu")

# Query/key block sizes of the blockwise path: a [block_q, block_k] float32 tile per (row, head) is live at a time.
BLOCK_Q = 256
BLOCK_K = 256


@functools.partial(jax.tree_util.register_dataclass, data_fields=["ids"], meta_fields=["single"])
@dataclass(frozen=True)
class Segments:
    """Which datum each token of a row belongs to: `ids` int32 [B, T], 1, 2, ... per packed datum, 0 for padding.
    `single` (static): every row holds at most one segment, from index 0 (what cuDNN's fused kernel needs)."""

    ids: jax.Array
    single: bool = False

    @staticmethod
    def right_padded(lengths: jax.Array, t: int) -> Segments:
        """Rows of one datum each, right-padded: `lengths` [B] real tokens per row."""
        return Segments((jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.int32), single=True)

    @staticmethod
    def whole(b: int, t: int) -> Segments:
        """Every token of every row real, one datum per row."""
        return Segments(jnp.ones((b, t), jnp.int32), single=True)


def select(dtype, *, single_segment: bool, backend: str | None = None) -> Implementation:
    """The implementation for a call on `backend` (default: JAX's) with q/k/v in `dtype`; `single_segment`: every
    row holds at most one segment starting at index 0 (no packing), which cuDNN needs."""
    forced = env_setting("attention")  # TINKERFLOW_ATTENTION, checked against IMPLEMENTATIONS by Settings
    backend = backend or jax.default_backend()
    low_precision = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if forced == "cudnn" and not (backend == "gpu" and low_precision and single_segment):
        forced = "auto"  # asked for where it cannot apply: the backend's default instead
    if (forced == "pallas_tpu" and backend != "tpu") or (forced == "pallas_gpu" and backend != "gpu"):
        forced = "auto"
    if forced != "auto":
        return forced  # type: ignore[return-value]
    if backend == "gpu":
        return "cudnn" if low_precision and single_segment else "pallas_gpu"
    if backend == "tpu":
        return "pallas_tpu"
    return "blockwise"


def single_segment_matters(backend: str | None = None) -> bool:
    """Whether rows of one segment each may take another kernel than packed rows on this backend (cuDNN on GPU):
    elsewhere the flag would only multiply compiled programs."""
    return (backend or jax.default_backend()) == "gpu"


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_segments: jax.Array,
    kv_segments: jax.Array,
    *,
    q_offset: int = 0,
    single_segment: bool = False,
    implementation: Implementation | None = None,
) -> jax.Array:
    """Causal attention within segments (module docstring); float32 [B, T, H * D]."""
    impl = implementation or select(q.dtype, single_segment=single_segment)
    b, t, h, d = q.shape
    if impl == "reference":
        out = reference_attention(q, k, v, q_segments, kv_segments, q_offset=q_offset)
    elif impl == "cudnn":
        out = _cudnn(q, k, v, q_segments, kv_segments, q_offset)
    elif impl == "pallas_tpu":
        out = _pallas_tpu(q, k, v, q_segments, kv_segments, q_offset)
    elif impl == "pallas_gpu" and q_offset == 0 and q.shape[1] == k.shape[1]:
        out = _pallas_gpu(q, k, v, q_segments)
    else:
        out = blockwise_attention(q, k, v, q_segments, kv_segments, q_offset=q_offset)
    return out.reshape(b, t, h * d)


def _visible(q_seg: jax.Array, kv_seg: jax.Array, q_index: jax.Array, k_index: jax.Array) -> jax.Array:
    """[B, Tq, Tk]: same non-padding segment, key at or before the query."""
    same = (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] > 0)
    return same & (k_index[None, None, :] <= q_index[None, :, None])


def reference_attention(q, k, v, q_segments, kv_segments, *, q_offset: int = 0) -> jax.Array:
    """The materialised attention (quadratic memory): float32 [B, T, H, D]."""
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    qg = q.reshape(b, t, kvh, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
    visible = _visible(q_segments, kv_segments, jnp.arange(t) + q_offset, jnp.arange(s))
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    # Queries that see nothing (padding) answer zero, as every other implementation does.
    out = jnp.where(visible.any(-1)[:, :, None, None, None], out, 0.0)
    return out.reshape(b, t, h, d)


# ---------------------------------------------------------------------------------------------------- blockwise


def blockwise_attention(
    q, k, v, q_segments, kv_segments, *, q_offset: int = 0, block_q: int = BLOCK_Q, block_k: int = BLOCK_K
) -> jax.Array:
    """Flash-style attention (module docstring): float32 [B, T, H, D]."""
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    bq, bk = min(block_q, t), min(block_k, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    qg = _pad(q.reshape(b, t, kvh, h // kvh, d), tp)
    out: jax.Array = _flash(qg, _pad(k, sp), _pad(v, sp), _pad(q_segments, tp), _pad(kv_segments, sp), q_offset, bq, bk)  # pyright: ignore[reportAssignmentType]  (custom_vjp's return type is opaque)
    return out[:, :t].reshape(b, t, h, d)


def _pad(x: jax.Array, length: int) -> jax.Array:
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
    return scores, _visible(qs_i, ks_j, q_index, k_index)[:, None, None]


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


# ---------------------------------------------------------------------------------------------------- fused kernels


def _cudnn(q, k, v, q_segments, kv_segments, q_offset: int) -> jax.Array:
    """cuDNN's fused attention; rows are one segment from index 0 (the caller checked), so lengths say it all."""
    if q_offset:
        raise ValueError("the cudnn attention path takes no q_offset")
    q_len = jnp.sum(q_segments > 0, axis=1).astype(jnp.int32)
    kv_len = jnp.sum(kv_segments > 0, axis=1).astype(jnp.int32)
    out = jax.nn.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=q_len, key_value_seq_lengths=kv_len, implementation="cudnn"
    )
    valid = (q_segments > 0)[:, :, None, None]
    return jnp.where(valid, out.astype(jnp.float32), 0.0)


def _pallas_gpu(q, k, v, segments) -> jax.Array:
    """jax's Pallas (Triton) GPU flash attention: [B, T, H, D], equal q and kv heads, one segment-id array for
    queries and keys (self-attention), causal; T padded to its block multiple."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    t = q.shape[1]
    block = 128
    padded = -(-t // block) * block
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    q, k, v, seg = (_pad(x, padded) for x in (q, k, v, segments))
    # Padding (segment 0) sees only padding, never a real token, and its output is zeroed below.
    out: jax.Array = pallas_attention.mha(q, k, v, seg, sm_scale=q.shape[-1] ** -0.5, causal=True)  # pyright: ignore[reportAssignmentType]
    out = out[:, :t].astype(jnp.float32)
    return jnp.where((segments > 0)[:, :, None, None], out, 0.0)


def _pallas_tpu(q, k, v, q_segments, kv_segments, q_offset: int) -> jax.Array:
    """jax's Pallas TPU flash attention ([B, H, T, D] layout, equal q and kv heads, segment ids, causal)."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    if q_offset:
        raise ValueError("the pallas_tpu attention path takes no q_offset")
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    q_t, k_t, v_t = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    # Padding queries get segment -1 so they match no key (the kernel has no notion of padding).
    seg = fa.SegmentIds(q=jnp.where(q_segments > 0, q_segments, -1), kv=kv_segments)
    out = fa.flash_attention(q_t, k_t, v_t, segment_ids=seg, causal=True, sm_scale=q.shape[-1] ** -0.5)
    out = jnp.swapaxes(out, 1, 2).astype(jnp.float32)
    return jnp.where((q_segments > 0)[:, :, None, None], out, 0.0)


# ---------------------------------------------------------------------------------------------------- decoding


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, positions: jax.Array,
                     block: int = 512) -> jax.Array:  # fmt: skip
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


def suffix_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, positions: jax.Array,
                     block: int = 256) -> jax.Array:  # fmt: skip
    """Several query tokens per row (q [B, T, H, D], at `positions` [B, T]) continuing rows whose earlier keys and
    values are in cache[layer] (k/v caches [L, B, S, KV, D]): a prompt's suffix after its cached prefix. A query at
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

    def step(j, carry):
        m, den, acc = carry  # [B, T, KV, G], [B, T, KV, G], [B, T, KV, G, D]
        start = (layer, 0, j * blk, 0, 0)
        kj = jax.lax.dynamic_slice(k_cache, start, (1, b, blk, kvh, d))[0]
        vj = jax.lax.dynamic_slice(v_cache, start, (1, b, blk, kvh, d))[0]
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
