"""Qwen3.5's decoder layer and text model (transformers' `Qwen3_5DecoderLayer`, `Qwen3_5ForCausalLM` and their MoE
twins) in Flax NNX, multi-LoRA on every linear.

Each layer runs the mixer its `layer_types` entry names, Gated DeltaNet (`linear_attn`, linear_attention.py) or
gated full attention (`self_attn`, layers.py), between zero-centred RMSNorms, then the MLP: a dense SwiGLU, or in
the MoE variant the routed experts plus the gated shared expert (sparse_moe.py). The model is `embed_tokens`, the
layers, the final `norm` and `lm_head` (the engine's embedding and LM head, tied or not, with the unembedding LoRA
applied to the tied lookup too, as decoder.CausalLM), so state paths read as the checkpoint's names
(`layers.0.linear_attn.in_proj_qkv.kernel` for `model.layers.0.linear_attn.in_proj_qkv.weight`).

A vision-language checkpoint's model also holds the vision tower (`visual`, vision.py; plain weights, no LoRA): a
training batch with images (vision_batch.ImageBatch) runs the tower over them, its features take the place of the
image placeholder tokens' embeddings, and the full-attention layers turn with the 3-D multimodal positions
(vision_merge.py). Without images the call is the text model's, unchanged.

The layers are a per-layer list (as decoder.py's MoE models): the two mixers hold different parameters, so one
scanned body cannot run every layer; stacking each kind's layers for a scan is left to the engine's integration.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ...attention import Segments
from ...decoder import constrain
from ...embedding import Embedding, LMHead
from ...image_inputs import PromptImages
from ...lora import LoraRouting, ModuleKind, lora_embedding_delta
from ...remat import Remat, checkpointed
from ...rope import rope_tables
from .cache import HybridCache, HybridRowCache, layer_slots
from .config import LINEAR_ATTENTION, Qwen35Config
from .layers import MLP, GatedAttention, KVView, ZeroCenteredRMSNorm
from .linear_attention import GatedDeltaNet, LinearAttentionState
from .sparse_moe import SparseMoeBlock
from .vision import VisionModel
from .vision_batch import ImageBatch
from .vision_merge import embed_images, embed_prompt_features, mrope_tables

# The LoRA module groups (train_attn / train_mlp) of the linears Qwen3.5 adds to those `lora.module_kind` knows.
LORA_KINDS: dict[str, ModuleKind] = {
    "in_proj_qkv": "attn",
    "in_proj_z": "attn",
    "in_proj_b": "attn",
    "in_proj_a": "attn",
    "out_proj": "attn",
    "shared_expert_gate": "mlp",
}


class DecoderLayer(nnx.Module):
    def __init__(
        self,
        config: Qwen35Config,
        layer_type: str,
        *,
        max_adapters: int,
        max_rank: int,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
    ):
        kw: dict[str, Any] = dict(max_adapters=max_adapters, max_rank=max_rank, rngs=rngs, param_dtype=param_dtype)
        h = config.hidden_size
        self.layer_type = layer_type
        self.input_layernorm = ZeroCenteredRMSNorm(h, config.rms_norm_eps)
        if layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(config, **kw)
        else:
            self.self_attn = GatedAttention(config, **kw)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(h, config.rms_norm_eps)
        self.mlp: SparseMoeBlock | MLP
        if config.num_experts:
            self.mlp = SparseMoeBlock(config, **kw)
        else:
            self.mlp = MLP(h, config.intermediate_size, **kw)

    def __call__(
        self,
        x: jax.Array,
        rope: tuple[jax.Array, jax.Array],
        routing: LoraRouting,
        segments: Segments | None = None,
        state: LinearAttentionState | None = None,
        kv: KVView | None = None,
    ) -> tuple[jax.Array, LinearAttentionState | KVView | None]:
        """(x after the layer, its mixer's cache after the call: the linear-attention state, or the full-attention
        layer's `kv` view; `state` and `kv` are the caches going in, each read by its own kind of layer only)."""
        x = x.astype(jnp.float32)  # a residual stream kept in the compute dtype (CausalLM.residual_dtype) widens here
        mixed = self.input_layernorm(x)
        after: LinearAttentionState | KVView | None
        if self.layer_type == LINEAR_ATTENTION:
            mixed, after = self.linear_attn(mixed, routing, segments, state)
        else:
            mixed, after = self.self_attn(mixed, rope, routing, segments, kv)
        x = x + mixed
        return x + self.mlp(self.post_attention_layernorm(x), routing), after


def _layer_output(layer: DecoderLayer, x, rope, routing, segments):
    return layer(x, rope, routing, segments)[0]


class CausalLM(nnx.Module):
    """The text model as the engine builds it (`Family.causal_lm`): `remat` and `act_sharding` as decoder.CausalLM;
    `scan_layers` is taken and has no effect, nor has `decode_layers` (the layers differ, see the module doc);
    `compute_dtype_residual` as decoder.CausalLM."""

    def __init__(
        self,
        config: Qwen35Config,
        *,
        max_adapters: int,
        max_rank: int,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
        remat: Remat | bool = False,
        act_sharding=None,
        scan_layers: bool = False,
        compute_dtype_residual: bool = False,
    ):
        self.config = config
        self.remat = Remat.of(remat)
        self.compute_dtype_residual = compute_dtype_residual
        self.act_sharding = act_sharding
        self.scan_layers = False
        self.decode_layers = "scan"  # what the sampler sets on every model (decoder.CausalLM); a per-layer loop here
        kw: dict[str, Any] = dict(max_adapters=max_adapters, max_rank=max_rank, rngs=rngs, param_dtype=param_dtype)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, param_dtype)
        self.layers = nnx.List([DecoderLayer(config, kind, **kw) for kind in config.layer_types])
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = LMHead(config, max_adapters=max_adapters, max_rank=max_rank, param_dtype=param_dtype)
        self.visual = VisionModel(config.vision, param_dtype) if config.vision is not None else None

    @property
    def dtype(self):
        """The compute dtype of matmuls (the base weights' dtype)."""
        return self.embed_tokens.weight[...].dtype

    @property
    def residual_dtype(self):
        """The residual stream's dtype between layers (decoder.CausalLM.residual_dtype)."""
        return self.dtype if self.compute_dtype_residual else jnp.float32

    def hidden(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        routing: LoraRouting,
        cache: HybridCache | HybridRowCache | None = None,
        segments: Segments | None = None,
        *,
        remat: Remat | bool | None = None,
        images: ImageBatch | None = None,
        prompt_images: PromptImages | None = None,
    ) -> tuple[jax.Array, HybridCache | HybridRowCache | None]:
        """Final-norm hidden states [B, T, hidden] for tokens [B, T] at `positions` [B, T] (restarting at each packed
        datum), and the cache after them when one is given. `segments`: which datum each token belongs to (None: one
        per row, every token real). `remat` overrides the model's gradient checkpointing for this call
        (decoder.CausalLM.hidden; without a cache only).

        With `cache` (cache.py), each row continues what its slot holds: full-attention layers write their keys
        and values at `positions` and read the slot's earlier ones; linear layers continue the slot's state (zero
        for a `fresh` row) over the row's real tokens (`lengths` of a row view; a whole cache's call is one
        decode token per slot) and leave the state after the last of them.

        `images` (a training batch's, without a cache): the tower's features replace the placeholders' embeddings
        and its 3-D positions give the rope (`positions` then only matter where they equal them: text).
        `prompt_images` (a sampler's, with a cache): features the tower gave before take the placeholders' place and
        its 3-D positions give the rope, while `positions` still say where each token's keys go in its slot."""
        remat = Remat.of(self.remat if remat is None else remat)
        x = self.embed_tokens(tokens)
        if self.lm_head.tied:  # the unembedding LoRA updates the shared matrix, so the lookup too (see lora.py)
            x = x + lora_embedding_delta(tokens, self.lm_head.lora_a[...], self.lm_head.lora_b[...], routing)
        if images is not None:
            x, rope = self._with_images(tokens, x, images)
        elif prompt_images is not None:
            x, deepstack = embed_prompt_features(x, prompt_images.mask, prompt_images.features)
            assert deepstack is None, "Qwen3.5's tower gives no DeepStack features"
            rope = self._mrope(prompt_images.positions)
        else:
            rope = rope_tables(self.config, positions)
        x = constrain(x.astype(self.residual_dtype), self.act_sharding)
        if cache is None:
            for layer in self.layers:
                x = checkpointed(remat, layer, _layer_output, x, rope, routing, segments)
                x = constrain(x.astype(self.residual_dtype), self.act_sharding)
            return self.norm(x.astype(jnp.float32)), None
        rows = cache.rows if isinstance(cache, HybridRowCache) else None
        linear_segments = segments
        if isinstance(cache, HybridRowCache) and segments is None:  # the chunk's tail past a prompt is padding
            linear_segments = Segments.right_padded(cache.lengths, tokens.shape[1])
        for layer, slot in zip(self.layers, layer_slots(self.config), strict=True):
            if layer.layer_type == LINEAR_ATTENTION:
                x, state = layer(x, rope, routing, linear_segments, cache.state(slot))
                assert isinstance(state, LinearAttentionState)
                cache = cache.with_state(slot, state)
            else:
                x, kv = layer(x, rope, routing, segments, kv=KVView(cache.k, cache.v, slot, positions, rows))
                assert isinstance(kv, KVView)
                cache = cache._replace(k=kv.k, v=kv.v)
            x = x.astype(self.residual_dtype)  # as the training path rounds it, so sampler and trainer agree
        return self.norm(x.astype(jnp.float32)), cache

    def _with_images(
        self, tokens: jax.Array, x: jax.Array, images: ImageBatch
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """The embeddings with the images' features at their placeholders, and the multimodal rope tables."""
        config = self.config
        if self.visual is None or config.image_token_id is None:
            raise ValueError(f"{config.arch}: this checkpoint has no vision tower, so it takes no images")
        features, deepstack = self.visual(images.patches, images.vision)
        x, extra = embed_images(x, tokens, config.image_token_id, features, deepstack)
        assert extra is None, "Qwen3.5's tower gives no DeepStack features"
        return x, self._mrope(images.positions)

    def _mrope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The multimodal rope tables of 3-D positions [B, T, 3]."""
        config = self.config
        return mrope_tables(jnp.moveaxis(positions, -1, 0), config.inv_freq(), config.mrope_section)

    def logits(self, h: jax.Array, routing: LoraRouting) -> jax.Array:
        return self.lm_head(h, self.embed_tokens, routing)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, routing: LoraRouting, segments: Segments | None = None
    ) -> jax.Array:
        return self.logits(self.hidden(tokens, positions, routing, segments=segments)[0], routing)
