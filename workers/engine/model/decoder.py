"""The decoder-only causal LM the dense and routed-expert families share, in Flax NNX, with multi-LoRA on every linear
and an optional KV cache: attention (q/k norm as the config says), an MLP the family chooses per layer (the dense
SwiGLU here, or moe.py's routed experts), the embedding, the LM head, and the model that asks its family for its
layers (families/).

Attribute names mirror the Hugging Face module tree (`layers[i].self_attn.q_proj`, `mlp.gate_proj`, ...) so the
loader maps safetensors names onto NNX state paths mechanically.

Dtypes: base matrices (linear kernels, the embedding) are stored in `param_dtype` (float32 on CPU, where it is
faster than bf16 and parity with transformers is asserted at 1e-4; bfloat16 on accelerators). Every matmul casts its
activation to the weight's dtype and accumulates in float32 (`preferred_element_type`); the residual stream, norms,
rope, softmax, LoRA parameters and logits stay float32, so with float32 weights nothing is ever cast.

Layers stacked and scanned (`scan_layers`, the default for dense models): `layers` is one `DecoderStack` whose base
leaves carry a leading layer axis ([L, in, out]) and whose LoRA leaves carry it second ([S, L, in, R], so the adapter
axis stays first for slot writes, snapshots and the optimizer), and `hidden` runs the layers as one `jax.lax.scan`:
the program holds one layer's computation whatever the depth, so compile time does not grow with it. The LoRA
leaves are moved layer-first once per call for the scan (a copy of the LoRA state, which is small next to the base
weights; the base weights are never copied). A family whose layers differ (a mixture of experts may mix dense and
sparse layers, which one scan body cannot hold) has no stack (`Family.decoder_stack` None) and runs the per-layer
loop (`nnx.List`). The KV cache is one kv_cache.LayerCache of [L, B, S, kv_heads, head_dim] arrays in both layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import Segments, attention
from .cached_attention import attend_cached, write_kv
from .embedding import Embedding, LMHead
from .families import CacheKind, LayerOptions, ModelConfig, ModuleKind, family_named
from .kv_cache import LayerCache, RowCache
from .lora import LoRALinear, LoraRouting, StackedLoraRouting, lora_embedding_delta
from .remat import Remat, checkpoint, checkpointed
from .rope import apply_rope, rope_tables

# What a model adds to the residual stream after a layer: (layer index, x [B, T, H]) -> x (CausalLM.decode).
AfterLayer = Callable[[Any, jax.Array], jax.Array]

# The LoRA target modules of the layers here (moe.py's experts name their projections as the MLP does) by train group,
# named as PEFT and Tinker exports name them (the unembedding: Tinker's `unembed_tokens`, our `lm_head`).
DECODER_TARGETS: dict[str, ModuleKind] = {
    "q_proj": "attn",
    "k_proj": "attn",
    "v_proj": "attn",
    "o_proj": "attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
    "unembed_tokens": "unembed",
}


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


class DecoderStack(DecoderLayer):
    """`num_layers` identical decoder layers stored as one: every base leaf gains a leading layer axis ([L, ...]),
    every LoRA leaf a layer axis after its adapter axis ([S, L, ...], the adapter axis stays first: see the module
    doc). Built from one layer's (deterministic: zeros, ones) initial values repeated; the loader fills the real
    weights layer by layer. `CausalLM.hidden` scans over it; indexing gives one layer as a `DecoderLayer` view (for
    tests and inspection, not for the hot path)."""

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
        super().__init__(config, mlp, max_adapters=max_adapters, max_rank=max_rank, rngs=rngs, param_dtype=param_dtype)
        self.num_layers = config.num_layers
        n = config.num_layers
        lora, rest = nnx.state(self, nnx.LoRAParam, ...)
        nnx.update(
            self,
            jax.tree.map(lambda x: jnp.repeat(x[:, None], n, axis=1), lora),
            jax.tree.map(lambda x: jnp.repeat(x[None], n, axis=0), rest),
        )

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, i: int) -> DecoderLayer:
        graphdef, lora, rest = nnx.split(self, nnx.LoRAParam, ...)
        view = nnx.merge(graphdef, jax.tree.map(lambda x: x[:, i], lora), jax.tree.map(lambda x: x[i], rest))
        return view

    def __iter__(self):
        return (self[i] for i in range(self.num_layers))

    def scan(
        self,
        x,
        positions,
        rope,
        routing,
        cache: LayerCache | RowCache | None,
        *,
        remat: Remat,
        act_sharding,
        segments: Segments | None = None,
        after_layer: AfterLayer | None = None,
    ):
        """Every layer in order as one `jax.lax.scan` over the layer axis; the cache (all layers') rides in the
        carry and each layer writes its slice in place; `after_layer` as `CausalLM.decode` takes it (its layer
        index traced).

        Gradient checkpointing (`remat`, remat.py): `jax.checkpoint` around the scanned body, so the backward pass
        keeps one [B, T, H] hidden state per layer (the scan's carry) and recomputes the layer's insides from it
        (FULL), or only its elementwise work between the saved matmul outputs (DOTS), as the per-layer
        `checkpointed` of the loop does."""
        graphdef, lora, rest = nnx.split(self, nnx.LoRAParam, ...)
        lora = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), lora)  # layer-first for the scan: LoRA-sized copy

        def body(carry, xs):
            x, cache = carry
            carried = x.dtype  # the residual stream's dtype between layers (CausalLM.residual_dtype)
            layer_lora, layer_rest, i = xs
            layer = nnx.merge(graphdef, layer_lora, layer_rest)
            x, cache = DecoderLayer.__call__(layer, x, positions, rope, routing, cache, i, segments)
            if after_layer is not None:
                x = after_layer(i, x)
            return (constrain(x.astype(carried), act_sharding), cache), None

        if cache is None:
            body = checkpoint(body, remat, prevent_cse=False)  # prevent_cse is not needed inside scan (JAX's advice)
        layers = jnp.arange(self.num_layers, dtype=jnp.int32)
        (x, cache), _ = jax.lax.scan(body, (x, cache), (lora, rest, layers))
        return x, cache


def _layer_no_cache(layer: DecoderLayer, x, positions, rope, routing, segments=None):
    return layer(x, positions, rope, routing, None, 0, segments)[0]


def dense_layer(config: ModelConfig, index: int, options: LayerOptions) -> DecoderLayer:
    """A dense family's layer `index`: attention and the SwiGLU MLP."""
    return DecoderLayer(config, MLP(config, **options.kwargs()), **options.kwargs())


def dense_stack(config: ModelConfig, options: LayerOptions) -> DecoderStack:
    """A dense family's layers, stacked for the scan."""
    return DecoderStack(config, MLP(config, **options.kwargs()), **options.kwargs())


def kv_every_layer(config: ModelConfig) -> tuple[CacheKind, ...]:
    """What the sampler keeps of this decoder: every layer's keys and values (`LayerCache`)."""
    return ("kv",) * config.num_layers


class CausalLM(nnx.Module):
    """The decoder, with the layers its family builds. `remat` (gradient checkpointing), `act_sharding` (the
    [B, T, H] hidden-state sharding between layers) and `scan_layers` (stacked layers, one scan, where the family
    stacks them: see the module doc) are static settings, fixed when the engine builds the model.

    `compute_dtype_residual`: the residual stream between layers (what gradient checkpointing saves per layer) is
    kept in the compute dtype (bf16 with bf16 weights) instead of float32; each layer still adds in float32 and
    rounds its output once. Off by default: it changes bf16 numerics (tests/engine/test_remat_bf16.py measures how
    much); with float32 weights it changes nothing."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        max_adapters: int,
        max_rank: int,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
        remat: Remat | bool = False,
        act_sharding=None,
        scan_layers: bool = True,
        compute_dtype_residual: bool = False,
    ):
        self.config = config
        self.remat = Remat.of(remat)
        self.compute_dtype_residual = compute_dtype_residual
        self.act_sharding = act_sharding
        family = family_named(config.arch)
        options = LayerOptions(max_adapters=max_adapters, max_rank=max_rank, rngs=rngs, param_dtype=param_dtype)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, param_dtype)
        self.layers: nnx.Module
        if scan_layers and family.decoder_stack is not None:
            self.layers = family.decoder_stack(config, options)
        else:
            self.layers = nnx.List([family.decoder_layer(config, i, options) for i in range(config.num_layers)])
        self.scan_layers = isinstance(self.layers, DecoderStack)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = LMHead(config, max_adapters=max_adapters, max_rank=max_rank, param_dtype=param_dtype)

    @property
    def dtype(self):
        """The compute dtype of matmuls and of the KV cache (the base weights' dtype)."""
        return self.embed_tokens.weight[...].dtype

    @property
    def residual_dtype(self):
        """The residual stream's dtype between layers: float32, or the compute dtype (`compute_dtype_residual`)."""
        return self.dtype if self.compute_dtype_residual else jnp.float32

    def hidden(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        routing: LoraRouting | StackedLoraRouting,
        cache: LayerCache | RowCache | None = None,
        segments: Segments | None = None,
        *,
        remat: Remat | bool | None = None,
    ) -> tuple[jax.Array, LayerCache | RowCache | None]:
        """Final-norm hidden states [B, T, H] (and the updated cache when one is given). `segments`: which datum
        each token belongs to (packed rows; None: one datum per row, every token real). `remat` overrides the
        model's gradient checkpointing for this call (the training step picks its level by length: remat.py)."""
        x = self.embed(tokens, routing)
        return self.decode(x, positions, rope_tables(self.config, positions), routing, cache, segments, remat=remat)

    def embed(self, tokens: jax.Array, routing: LoraRouting | StackedLoraRouting) -> jax.Array:
        """The tokens' embeddings [B, T, H], with the unembedding LoRA's share where the embeddings are tied."""
        x = self.embed_tokens(tokens)
        if self.lm_head.tied:  # the unembedding LoRA updates the shared matrix, so the lookup too (see lora.py)
            x = x + lora_embedding_delta(tokens, self.lm_head.lora_a[...], self.lm_head.lora_b[...], routing)
        return x

    def decode(
        self,
        x: jax.Array,
        positions: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        routing: LoraRouting | StackedLoraRouting,
        cache: LayerCache | RowCache | None = None,
        segments: Segments | None = None,
        *,
        remat: Remat | bool | None = None,
        after_layer: AfterLayer | None = None,
    ) -> tuple[jax.Array, LayerCache | RowCache | None]:
        """`hidden` from the embeddings `x` on: the layers, turning q and k by the `rope` tables (cos, sin
        [B, T, head_dim]; a multimodal model's are not those of `positions`, which still place the cache's keys),
        then the final norm. `after_layer(i, x)`, when given, is the residual stream after layer i (Qwen3-VL adds
        its DeepStack image features to the first layers' there); i is an int, or a traced int32 in the scan."""
        remat = Remat.of(self.remat if remat is None else remat)
        x = constrain(x.astype(self.residual_dtype), self.act_sharding)
        if isinstance(self.layers, DecoderStack):
            x, cache = self.layers.scan(
                x,
                positions,
                rope,
                routing,
                cache,
                remat=remat,
                act_sharding=self.act_sharding,
                segments=segments,
                after_layer=after_layer,
            )
            return self.norm(x.astype(jnp.float32)), cache
        assert isinstance(self.layers, nnx.List)  # built above: a stack or a per-layer list
        for i, layer in enumerate(self.layers):
            if cache is None:
                x = checkpointed(remat, layer, _layer_no_cache, x, positions, rope, routing, segments)
            else:
                x, cache = layer(x, positions, rope, routing, cache, i, segments)
            if after_layer is not None:
                x = after_layer(i, x)
            x = constrain(x.astype(self.residual_dtype), self.act_sharding)
        return self.norm(x.astype(jnp.float32)), cache

    def logits(self, h: jax.Array, routing: LoraRouting) -> jax.Array:
        return self.lm_head(h, self.embed_tokens, routing)

    def __call__(self, tokens: jax.Array, positions: jax.Array, routing: LoraRouting) -> jax.Array:
        h, _ = self.hidden(tokens, positions, routing)
        return self.logits(h, routing)


def build_causal_lm(config: ModelConfig, **options: Any) -> CausalLM:
    """The engine's model for `config`: its family's own causal LM (`Family.causal_lm`) or `CausalLM` over the
    family's layers; `options` as `CausalLM` takes them. Typed as `CausalLM`, whose interface (hidden, logits,
    dtype, lm_head, scan_layers) a family's own model has."""
    own = family_named(config.arch).causal_lm
    return CausalLM(config, **options) if own is None else cast(CausalLM, own(config, **options))
