"""Qwen3.5's norms, MLP and gated full attention in Flax NNX, multi-LoRA on every linear (`lora.LoRALinear`).

Attribute names mirror transformers' module tree (`self_attn.q_proj`, `q_norm`, `mlp.gate_proj`, ...) so a loader
maps safetensors names mechanically. Dtypes as decoder.py: matmuls in the weights' dtype with float32 accumulation,
everything else float32.

Two norms, which differ from Qwen3's:

* `ZeroCenteredRMSNorm` (input/post-attention layernorms, the final norm, q/k norms) scales by 1 + weight, its
  weight stored zero-centred (initialised to zeros), as `Qwen3_5RMSNorm`.
* `GatedRMSNorm` (inside Gated DeltaNet) scales by weight itself (initialised to ones) and multiplies by SiLU of a
  gate, as `Qwen3_5RMSNormGated`.

`GatedAttention`: q_proj emits each head's query and an output gate side by side ([..., H, 2 * D]); q and k are
RMS-normalised per head, rope turns only the leading `rotary_dim` dims of each head (partial rotary), and the
attention output is multiplied by sigmoid(gate) before o_proj.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ...attention import Segments, attention
from ...cached_attention import attend_cached, write_kv
from ...lora import LoRALinear, LoraRouting
from ...rope import apply_rope
from .config import Qwen35Config


def _normalize(x: jax.Array, eps: float) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class ZeroCenteredRMSNorm(nnx.Module):
    """x / rms(x) * (1 + weight)."""

    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.zeros((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return _normalize(x, self.eps) * (1.0 + self.weight[...].astype(jnp.float32))


class GatedRMSNorm(nnx.Module):
    """x / rms(x) * weight * silu(gate), over the last axis (one value head)."""

    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        return _normalize(x, self.eps) * self.weight[...].astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))


def lora_kwargs(max_adapters: int, max_rank: int, rngs: nnx.Rngs, param_dtype) -> dict[str, Any]:
    return dict(max_adapters=max_adapters, max_rank=max_rank, rngs=rngs, param_dtype=param_dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); the dense layers' MLP and the MoE block's shared expert."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        max_adapters: int,
        max_rank: int,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
    ):
        lora = lora_kwargs(max_adapters, max_rank, rngs, param_dtype)
        self.gate_proj = LoRALinear(hidden, intermediate, **lora)
        self.up_proj = LoRALinear(hidden, intermediate, **lora)
        self.down_proj = LoRALinear(intermediate, hidden, **lora)

    def __call__(self, x: jax.Array, routing: LoraRouting) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x, routing)) * self.up_proj(x, routing), routing)


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rope on the leading cos.shape[-1] dims of each head of x [B, T, H, D]; the rest pass through."""
    rot = cos.shape[-1]
    return jnp.concatenate([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], axis=-1)


class GatedAttention(nnx.Module):
    def __init__(
        self, config: Qwen35Config, *, max_adapters: int, max_rank: int, rngs: nnx.Rngs, param_dtype=jnp.float32
    ):
        self.config = config
        h, hd = config.hidden_size, config.head_dim
        lora = lora_kwargs(max_adapters, max_rank, rngs, param_dtype)
        self.q_proj = LoRALinear(h, config.num_heads * hd * 2, **lora)
        self.k_proj = LoRALinear(h, config.num_kv_heads * hd, **lora)
        self.v_proj = LoRALinear(h, config.num_kv_heads * hd, **lora)
        self.o_proj = LoRALinear(config.num_heads * hd, h, **lora)
        self.q_norm = ZeroCenteredRMSNorm(hd, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(hd, config.rms_norm_eps)

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        routing: LoraRouting,
        segments: Segments | None = None,
        cache: KVView | None = None,
    ) -> tuple[jax.Array, KVView | None]:
        """Causal attention within `segments` (packed rows; None: each row one sequence, every token real) for
        x [B, T, hidden]; `rope` the cos/sin tables [B, T, rotary_dim] at the tokens' positions. With `cache`
        (this layer's keys/values among the slots', as decoder.Attention's cache): the tokens' keys and values are
        written at their positions and the queries read the cache (a decode step, or a prompt's chunk after what
        the row holds), unless `segments` are given (a prefill from position 0 attending within the call)."""
        c = self.config
        b, t, _ = x.shape
        query_gate = self.q_proj(x, routing).reshape(b, t, c.num_heads, 2 * c.head_dim)
        q, gate = query_gate[..., : c.head_dim], query_gate[..., c.head_dim :].reshape(b, t, -1)
        k = self.k_proj(x, routing).reshape(b, t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x, routing).reshape(b, t, c.num_kv_heads, c.head_dim)
        q, k = apply_partial_rope(self.q_norm(q), *rope), apply_partial_rope(self.k_norm(k), *rope)
        cd = self.q_proj.kernel[...].dtype  # attention in the weights' dtype, float32 accumulation (decoder.py)
        q, k, v = q.astype(cd), k.astype(cd), v.astype(cd)
        if cache is not None:
            k_cache, v_cache = write_kv(k, v, cache.k, cache.v, cache.layer, cache.positions, cache.rows)
            cache = cache._replace(k=k_cache, v=v_cache)
            if segments is None:
                out = attend_cached(q, k_cache, v_cache, cache.layer, cache.positions, cache.rows)
                return self.o_proj(out * jax.nn.sigmoid(gate), routing), cache
        seg = segments if segments is not None else Segments.whole(b, t)
        out = attention(q, k, v, seg.ids, seg.ids, single_segment=seg.single)
        return self.o_proj(out * jax.nn.sigmoid(gate), routing), cache


class KVView(NamedTuple):
    """One full-attention layer's part of a sampling cache: the keys/values of every such layer and slot
    (cache.py), the layer's index among them, the tokens' positions [B, T] and the slot of each batch row (None:
    row b is slot b)."""

    k: jax.Array
    v: jax.Array
    layer: int
    positions: jax.Array
    rows: jax.Array | None
