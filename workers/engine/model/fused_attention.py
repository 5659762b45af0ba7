"""The fused attention kernels of accelerators, behind the same contract as the blockwise path (attention.py):
cuDNN's on GPU for rows of one segment (it takes row lengths, not segment ids), and the Pallas flash kernels shipped
with jax, Triton on GPU and Mosaic on TPU, for packed rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .blockwise_attention import pad


def cudnn(q, k, v, q_segments, kv_segments, q_offset: int) -> jax.Array:
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


def pallas_gpu(q, k, v, segments) -> jax.Array:
    """jax's Pallas (Triton) GPU flash attention: [B, T, H, D], equal q and kv heads, one segment-id array for
    queries and keys (self-attention), causal; T padded to its block multiple."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    t = q.shape[1]
    block = 128
    padded = -(-t // block) * block
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    q, k, v, seg = (pad(x, padded) for x in (q, k, v, segments))
    # Padding (segment 0) sees only padding, never a real token, and its output is zeroed below.
    out: jax.Array = pallas_attention.mha(q, k, v, seg, sm_scale=q.shape[-1] ** -0.5, causal=True)  # pyright: ignore[reportAssignmentType]
    out = out[:, :t].astype(jnp.float32)
    return jnp.where((segments > 0)[:, :, None, None], out, 0.0)


def pallas_tpu(q, k, v, q_segments, kv_segments, q_offset: int) -> jax.Array:
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
