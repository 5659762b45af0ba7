"""One decoder layer of the dense and routed-expert families (model/decoder.py's module doc says how they make a
model): RMSNorm, attention with multi-LoRA on every projection and an optional KV cache, the dense SwiGLU MLP (or the
family's block in its place: moe.py's routed experts), and the residual stream around them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import Segments, attention
from .cached_attention import attend_cached, write_kv
from .families import ModelConfig
from .kv_cache import LayerCache, RowCache
from .lora import LoRALinear, LoraRouting
from .rope import apply_rope

# What a model adds to the residual stream after a layer: (layer index, x [B, T, H]) -> x (CausalLM.decode).
AfterLayer = Callable[[Any, jax.Array], jax.Array]


def constrain(x: jax.Array, sharding) -> jax.Array:
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
        return self.weight[...] * (x * jax.lax.rsqrt(var + self.eps))


class Attention(nnx.Module):
    def __init__(
        self, config: ModelConfig, *, max_adapters: int, max_rank: int, rngs: nnx.Rngs, param_dtype=jnp.float32
    ):
        self.config = config
        h, hd = config.hidden_size, config.head_dim
        lora: dict[str, Any] = dict(max_adapters=max_adapters, max_rank=max_rank, rngs=rngs, param_dtype=param_dtype)
        self.q_proj = LoRALinear(h, config.num_heads * hd, **lora)
        self.k_proj = LoRALinear(h, config.num_kv_heads * hd, **lora)
        self.v_proj = LoRALinear(h, config.num_kv_heads * hd, **lora)
        self.o_proj = LoRALinear(config.num_heads * hd, h, **lora)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        routing: LoraRouting,
        cache: LayerCache | RowCache | None,
        layer: jax.Array | int = 0,
        segments: Segments | None = None,
    ) -> tuple[jax.Array, LayerCache | RowCache | None]:
        """Without a cache: causal attention within `segments` (packed rows; None: each row one segment).
        With a cache (every layer's, [L, B, S, ...]): one token per row decodes against the row's filled part of
        cache[layer]; several tokens per row write their keys/values at cache[layer] and, with `segments`, prefill
        from position 0 (attending to each other), or without, continue the row's cached keys at their `positions`
        (a prompt's suffix after a cached prefix)."""
        c = self.config
        b, t, _ = x.shape
        q = self.q_proj(x, routing).reshape(b, t, c.num_heads, c.head_dim)
        k = self.k_proj(x, routing).reshape(b, t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x, routing).reshape(b, t, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # Attention runs in the weights' dtype with float32 accumulation; the cache holds k/v in that same dtype,
        # so cached decoding sees exactly the values a full forward does.
        cd = self.q_proj.kernel[...].dtype
        q, k, v = q.astype(cd), k.astype(cd), v.astype(cd)

        if cache is not None:
            view = cache.rows if isinstance(cache, RowCache) else None
            k_cache, v_cache = write_kv(k, v, cache.k, cache.v, layer, positions, view)
            cache = cache._replace(k=k_cache, v=v_cache)
            if segments is None or (t == 1 and view is None):
                return self.o_proj(attend_cached(q, k_cache, v_cache, layer, positions, view), routing), cache
        seg = segments if segments is not None else Segments.whole(b, t)
        out = attention(q, k, v, seg.ids, seg.ids, single_segment=seg.single)
        return self.o_proj(out, routing), cache


class MLP(nnx.Module):
    def __init__(
        self, config: ModelConfig, *, max_adapters: int, max_rank: int, rngs: nnx.Rngs, param_dtype=jnp.float32
    ):
        h, i = config.hidden_size, config.intermediate_size
        lora: dict[str, Any] = dict(max_adapters=max_adapters, max_rank=max_rank, rngs=rngs, param_dtype=param_dtype)
        self.gate_proj = LoRALinear(h, i, **lora)
        self.up_proj = LoRALinear(h, i, **lora)
        self.down_proj = LoRALinear(i, h, **lora)

    def __call__(self, x: jax.Array, routing: LoraRouting) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x, routing)) * self.up_proj(x, routing), routing)


class DecoderLayer(nnx.Module):
    """Attention, then `mlp` (the family's block for this layer: `MLP`, or moe.py's routed experts), each after an
    RMSNorm and with a residual around it."""

    def __init__(
        self,
        config: ModelConfig,
        mlp: nnx.Module,
        *,
        max_adapters: int,
        max_rank: int,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
    ):
        kw: dict[str, Any] = dict(max_adapters=max_adapters, max_rank=max_rank, rngs=rngs, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def __call__(self, x, positions, rope, routing, cache, layer: jax.Array | int = 0, segments=None):
        x = x.astype(jnp.float32)  # a residual stream kept in the compute dtype (`residual_dtype`) is widened here
        attn, cache = self.self_attn(self.input_layernorm(x), positions, rope, routing, cache, layer, segments)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x), routing)
        return x, cache
