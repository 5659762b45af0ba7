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

Layers stacked (`scan_layers`, the default for dense models): `layers` is one decoder_stack.DecoderStack whose base
leaves carry a leading layer axis ([L, in, out]) and whose LoRA leaves carry it second ([S, L, in, R], so the adapter
axis stays first for slot writes, snapshots and the optimizer). Training runs them as one `jax.lax.scan`, so compile
time does not grow with depth; calls with a KV cache (the sampler's) run them as `decode_layers` says, the scan or a
loop unrolled over static slices of the stacks (decoder_stack.py says why). A family whose layers differ (a mixture
of experts may mix dense and sparse layers, which one scan body cannot hold) has no stack (`Family.decoder_stack`
None) and runs the per-layer loop (`nnx.List`), whatever `decode_layers` says. The KV cache is one
kv_cache.LayerCache of [L, B, S, kv_heads, head_dim] arrays in both layouts. The layer itself (attention, MLP,
norms) is decoder_layer.py's.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
from flax import nnx

from .attention import Segments
from .decoder_layer import MLP, AfterLayer, DecoderLayer, RMSNorm, constrain
from .decoder_stack import DecodeLayers, DecoderStack
from .embedding import Embedding, LMHead
from .families import CacheKind, LayerOptions, ModelConfig, ModuleKind, family_named
from .kv_cache import LayerCache, RowCache
from .lora import LoraRouting, StackedLoraRouting, lora_embedding_delta
from .remat import Remat, checkpointed
from .rope import rope_tables

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
    stacks them: see the module doc) are static settings, fixed when the engine builds the model. `decode_layers`
    (how calls with a KV cache run a stack: "scan" or "unrolled", decoder_stack.py) is static too; the sampler's
    programs set it on the model they merge (sampling/decode.py), so one model serves both choices.

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
        self.decode_layers: DecodeLayers = "scan"
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
        if isinstance(self.layers, DecoderStack) and cache is not None and self.decode_layers == "unrolled":
            x, cache = self.layers.unrolled(
                x,
                positions,
                rope,
                routing,
                cache,
                act_sharding=self.act_sharding,
                segments=segments,
                after_layer=after_layer,
            )
            return self.norm(x.astype(jnp.float32)), cache
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
