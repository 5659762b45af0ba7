"""Qwen3.5's decoder layer and text model (transformers' `Qwen3_5DecoderLayer`, `Qwen3_5ForCausalLM` and their MoE
twins) in Flax NNX, multi-LoRA on every linear.

Each layer runs the mixer its `layer_types` entry names, Gated DeltaNet (`linear_attn`, linear_attention.py) or
gated full attention (`self_attn`, layers.py), between zero-centred RMSNorms, then the MLP: a dense SwiGLU, or in
the MoE variant the routed experts plus the gated shared expert (sparse_moe.py). The model is `embed_tokens`, the
layers, the final `norm` and `lm_head` (the engine's embedding and LM head, tied or not, with the unembedding LoRA
applied to the tied lookup too, as decoder.CausalLM), so state paths read as the checkpoint's names
(`layers.0.linear_attn.in_proj_qkv.kernel` for `model.layers.0.linear_attn.in_proj_qkv.weight`).

The layers are a per-layer list (as decoder.py's MoE models): the two mixers hold different parameters, so one
scanned body cannot run every layer; stacking each kind's layers for a scan is left to the engine's integration.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ...attention import Segments
from ...decoder import Embedding, LMHead, constrain, rope_tables
from ...lora import LoraRouting, ModuleKind, lora_embedding_delta
from .config import LINEAR_ATTENTION, Qwen35Config
from .layers import MLP, GatedAttention, ZeroCenteredRMSNorm
from .linear_attention import GatedDeltaNet, LinearAttentionState
from .sparse_moe import SparseMoeBlock

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
    ) -> tuple[jax.Array, LinearAttentionState | None]:
        """(x after the layer, the linear-attention state after the call; None for a full-attention layer)."""
        mixed = self.input_layernorm(x)
        if self.layer_type == LINEAR_ATTENTION:
            mixed, state = self.linear_attn(mixed, routing, segments, state)
        else:
            mixed = self.self_attn(mixed, rope, routing, segments)
        x = x + mixed
        return x + self.mlp(self.post_attention_layernorm(x), routing), state


def _remat_layer(layer: DecoderLayer, x, rope, routing, segments):
    """Gradient checkpointing: keep only the layer's input, recompute the layer in the backward pass (a pure
    `jax.checkpoint` over its split state, as decoder.py's per-layer loop)."""
    graphdef, state = nnx.split(layer)

    def run(state, x, rope, routing, segments):
        return nnx.merge(graphdef, state)(x, rope, routing, segments)[0]

    return jax.checkpoint(run)(state, x, rope, routing, segments)


class CausalLM(nnx.Module):
    """The text model as the engine builds it (`Family.causal_lm`): `remat` and `act_sharding` as decoder.CausalLM;
    `scan_layers` is taken and has no effect (the layers differ, see the module doc)."""

    def __init__(
        self,
        config: Qwen35Config,
        *,
        max_adapters: int,
        max_rank: int,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
        remat: bool = False,
        act_sharding=None,
        scan_layers: bool = False,
    ):
        self.config = config
        self.remat = remat
        self.act_sharding = act_sharding
        self.scan_layers = False
        kw: dict[str, Any] = dict(max_adapters=max_adapters, max_rank=max_rank, rngs=rngs, param_dtype=param_dtype)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, param_dtype)
        self.layers = nnx.List([DecoderLayer(config, kind, **kw) for kind in config.layer_types])
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = LMHead(config, max_adapters=max_adapters, max_rank=max_rank, param_dtype=param_dtype)

    @property
    def dtype(self):
        """The compute dtype of matmuls (the base weights' dtype)."""
        return self.embed_tokens.weight[...].dtype

    def hidden(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        routing: LoraRouting,
        cache: Any = None,
        segments: Segments | None = None,
        *,
        remat: bool | None = None,
    ) -> tuple[jax.Array, Any]:
        """Final-norm hidden states [B, T, hidden] for tokens [B, T] at `positions` [B, T] (restarting at each packed
        datum), and the cache; `segments`: which datum each token belongs to (None: one per row, every token real).
        `remat` overrides the model's gradient checkpointing for this call (decoder.CausalLM.hidden)."""
        if cache is not None:
            raise ValueError(f"{self.config.arch} has no sampler state cache yet: it cannot sample")
        remat = self.remat if remat is None else remat
        x = self.embed_tokens(tokens)
        if self.lm_head.tied:  # the unembedding LoRA updates the shared matrix, so the lookup too (see lora.py)
            x = x + lora_embedding_delta(tokens, self.lm_head.lora_a[...], self.lm_head.lora_b[...], routing)
        x = constrain(x, self.act_sharding)
        rope = rope_tables(self.config, positions)
        for layer in self.layers:
            if remat:
                x = _remat_layer(layer, x, rope, routing, segments)
            else:
                x, _ = layer(x, rope, routing, segments)
            x = constrain(x, self.act_sharding)
        return self.norm(x), cache

    def logits(self, h: jax.Array, routing: LoraRouting) -> jax.Array:
        return self.lm_head(h, self.embed_tokens, routing)

    def __call__(
        self, tokens: jax.Array, positions: jax.Array, routing: LoraRouting, segments: Segments | None = None
    ) -> jax.Array:
        return self.logits(self.hidden(tokens, positions, routing, segments=segments)[0], routing)
