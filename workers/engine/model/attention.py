"""Causal self-attention with memory linear in sequence length, and the materialised attention it replaces.

Every attention call here takes queries [B, T, H, D], keys/values [B, S, KV, D] (grouped-query: H = KV * G) in the
compute dtype and *segment ids* [B, T] / [B, S]: a query sees a key when both carry the same segment id (> 0; 0 is
padding) and the key's index in the row is at most the query's (`q_offset` shifts the queries' indices, for a
suffix of a row whose prefix keys are already cached). Several datums packed into one row are several segments;
a row of one datum is one segment. The result is float32 [B, T, H * D]; padding queries get exactly zero.

Implementations, chosen by `select` (blockwise_attention.py, fused_attention.py; attention against a KV cache is in
cached_attention.py) from the backend (TINKERFLOW_ATTENTION overrides it):

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
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp

from tinkerflow.common.settings import env_setting

from .blockwise_attention import blockwise_attention, visible
from .fused_attention import cudnn, pallas_gpu, pallas_tpu

Implementation = Literal["reference", "blockwise", "cudnn", "pallas_gpu", "pallas_tpu"]
IMPLEMENTATIONS: tuple[str, ...] = ("auto", "reference", "blockwise", "cudnn", "pallas_gpu", "pallas_tpu")


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
        out = cudnn(q, k, v, q_segments, kv_segments, q_offset)
    elif impl == "pallas_tpu":
        out = pallas_tpu(q, k, v, q_segments, kv_segments, q_offset)
    elif impl == "pallas_gpu" and q_offset == 0 and q.shape[1] == k.shape[1]:
        out = pallas_gpu(q, k, v, q_segments)
    else:
        out = blockwise_attention(q, k, v, q_segments, kv_segments, q_offset=q_offset)
    return out.reshape(b, t, h * d)


def reference_attention(q, k, v, q_segments, kv_segments, *, q_offset: int = 0) -> jax.Array:
    """The materialised attention (quadratic memory): float32 [B, T, H, D]."""
    b, t, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    qg = q.reshape(b, t, kvh, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * (d**-0.5)
    seen = visible(q_segments, kv_segments, jnp.arange(t) + q_offset, jnp.arange(s))
    scores = jnp.where(seen[:, None, None], scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    # Queries that see nothing (padding) answer zero, as every other implementation does.
    out = jnp.where(seen.any(-1)[:, :, None, None, None], out, 0.0)
    return out.reshape(b, t, h, d)
