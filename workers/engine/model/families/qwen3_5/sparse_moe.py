"""Qwen3.5-MoE's expert block (transformers' `Qwen3_5MoeSparseMoeBlock`): the routed experts of the engine's
Qwen3-MoE block (model/moe.py: softmax router, top-k renormalised, grouped expert matmuls, per-expert LoRA), plus a
shared expert every token passes through, scaled by a sigmoid gate of its own:

    out = routed_experts(x) + sigmoid(shared_expert_gate(x)) * shared_expert(x)

The routing semantics are the same as Qwen3-MoE's with norm_topk_prob (Qwen3.5-MoE's router always renormalises),
so the routed part is that block itself, inherited; only the shared expert is new here. The router stays frozen
(no LoRA, as PEFT leaves it); the shared expert and its gate are LoRA linears like every other.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ...lora import LoRALinear, LoraRouting
from ...moe import SparseMoeBlock as RoutedExperts
from .config import Qwen35Config
from .layers import MLP, lora_kwargs


class SparseMoeBlock(RoutedExperts):
    def __init__(
        self, config: Qwen35Config, *, max_adapters: int, max_rank: int, rngs: nnx.Rngs, param_dtype=jnp.float32
    ):
        if not config.norm_topk_prob:
            raise ValueError("Qwen3.5-MoE's router renormalises its top-k weights: norm_topk_prob must be set")
        super().__init__(config, max_adapters=max_adapters, max_rank=max_rank, param_dtype=param_dtype)
        lora = lora_kwargs(max_adapters, max_rank, rngs, param_dtype)
        h = config.hidden_size
        self.shared_expert = MLP(h, config.shared_expert_intermediate_size, **lora)
        self.shared_expert_gate = LoRALinear(h, 1, **lora)

    def __call__(self, x: jax.Array, routing: LoraRouting) -> jax.Array:
        shared = jax.nn.sigmoid(self.shared_expert_gate(x, routing)) * self.shared_expert(x, routing)
        return super().__call__(x, routing) + shared
