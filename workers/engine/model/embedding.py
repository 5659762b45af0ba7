"""The token embedding and the LM head every family shares: the head reuses the embedding matrix when the checkpoint
ties them, and its LoRA (train_unembed, Tinker's `unembed_tokens`) then updates that shared matrix, so a model applies
it to the lookup as well (`lora.lora_embedding_delta`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .families import ModelConfig
from .lora import LoraRouting, base_matmul, lora_delta


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, hidden_size: int, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.zeros((vocab_size, hidden_size), param_dtype))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0).astype(jnp.float32)


class LMHead(nnx.Module):
    """Unembedding with LoRA (train_unembed); reuses the embedding matrix when the checkpoint ties them, and then
    the LoRA is an update of that shared matrix, applied to the embedding lookup as well (`CausalLM.hidden`)."""

    def __init__(self, config: ModelConfig, *, max_adapters: int, max_rank: int, param_dtype=jnp.float32):
        if not config.tie_word_embeddings:
            self.kernel = nnx.Param(jnp.zeros((config.hidden_size, config.vocab_size), param_dtype))
        self.lora_a = nnx.LoRAParam(jnp.zeros((max_adapters, config.hidden_size, max_rank), jnp.float32))
        self.lora_b = nnx.LoRAParam(jnp.zeros((max_adapters, max_rank, config.vocab_size), jnp.float32))
        self.tied = config.tie_word_embeddings

    def __call__(self, h: jax.Array, embedding: Embedding, routing: LoraRouting) -> jax.Array:
        base = base_matmul(h, embedding.weight[...].T) if self.tied else base_matmul(h, self.kernel[...])
        return base + lora_delta(h, self.lora_a[...], self.lora_b[...], routing)
