"""Qwen3.5's answers: its own causal LM (model.py: zero-centred norms, partial rotary, hybrid layers), its checkpoint
names in both layouts (checkpoint.py), the LoRA targets its layers add, what the sampler would keep per layer, and
costs that count each layer by its kind. Also the MoE variant's (qwen3_5_moe/family.py reuses these)."""

from __future__ import annotations

from typing import Any

from ...decoder import DECODER_TARGETS
from ...layer_costs import swiglu_params
from .. import CacheKind, Family, ModelConfig, ModuleKind
from . import cache
from .checkpoint import Qwen35Names
from .config import LINEAR_ATTENTION, Qwen35Config
from .model import LORA_KINDS, CausalLM
from .tiny import TINY
from .tiny_vision import TINY_VISION
from .vision_batch import image_batch

LORA_TARGETS: dict[str, ModuleKind] = {**DECODER_TARGETS, **LORA_KINDS}
# The chunk length of gated_delta.chunk_gated_delta_rule as the model calls it (its default).
CHUNK = 64


def read_config(hf: dict[str, Any]) -> ModelConfig:
    return Qwen35Config.from_hf(hf)


def _qwen35(c: ModelConfig) -> Qwen35Config:
    if not isinstance(c, Qwen35Config):
        raise TypeError(f"a Qwen3.5 family needs a Qwen35Config, got {type(c).__name__}")
    return c


def cache_kinds(config: ModelConfig) -> tuple[CacheKind, ...]:
    """Gated DeltaNet layers keep a fixed-size state ("recurrent"), full-attention layers keys and values ("kv")."""
    return tuple("recurrent" if t == LINEAR_ATTENTION else "kv" for t in _qwen35(config).layer_types)


def _mixer_params(c: Qwen35Config, layer_type: str) -> int:
    h = c.hidden_size
    if layer_type == LINEAR_ATTENTION:  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj
        return h * c.conv_dim + h * c.linear_value_dim + 2 * h * c.linear_num_value_heads + c.linear_value_dim * h
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim  # q_proj emits the query and its output gate
    return h * 2 * q + 2 * h * kv + q * h


def _mlp_params(c: Qwen35Config) -> int:
    h = c.hidden_size
    if not c.num_experts:
        return swiglu_params(h, c.intermediate_size)
    routed = c.num_experts_per_tok * swiglu_params(h, c.moe_intermediate_size) + h * c.num_experts
    return routed + swiglu_params(h, c.shared_expert_intermediate_size) + h  # the shared expert and its gate


def matmul_params(config: ModelConfig) -> int:
    """Every layer's mixer (by its kind) and MLP (a sparse one: the top-k experts, the router and the shared expert)
    plus the unembedding H·V."""
    c = _qwen35(config)
    layers = sum(_mixer_params(c, t) + _mlp_params(c) for t in c.layer_types)
    return layers + c.hidden_size * c.vocab_size


def activation_bytes(config: ModelConfig, compute_bytes: int, max_rank: int) -> int:
    """One layer's forward intermediates per token, the wider kind of layer's (an estimate in the manner of
    layer_costs.layer_activation_bytes): normed inputs, the mixer's projections (float32 out of the matmul, then
    compute dtype), the Gated DeltaNet's conv output, its chunk's C x C products per value head and the per-chunk
    state [dk, dv] per head shared by the chunk's C tokens, the MLP's widths (a routed token: its top-k experts' and
    the shared expert's), residual adds, and x @ A of every adapted linear."""
    c = _qwen35(config)
    f32, h = 4, c.hidden_size
    width = (
        c.num_experts_per_tok * c.moe_intermediate_size + c.shared_expert_intermediate_size
        if c.num_experts
        else c.intermediate_size
    )
    mlp = 3 * width * f32 + width * compute_bytes
    lora = 8 * max_rank * f32
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    full = (3 * h + 2 * (2 * q + 2 * kv) + 2 * q + 2 * h) * f32 + (2 * q + 2 * kv) * compute_bytes
    nv, vd = c.linear_num_value_heads, c.linear_value_dim
    chunk = 3 * CHUNK * nv + 2 * nv * c.linear_key_head_dim * c.linear_value_head_dim // CHUNK
    linear = (3 * h + 3 * c.conv_dim + 4 * vd + chunk + 2 * h) * f32 + (c.conv_dim + 2 * vd) * compute_bytes
    kinds = set(c.layer_types)
    widest = max(full if "full_attention" in kinds else 0, linear if LINEAR_ATTENTION in kinds else 0)
    return widest + mlp + lora


def family(name: str, tiny: Any, tiny_vision: Any = None) -> Family:
    """The Family of one Qwen3.5 folder (`qwen3_5`, `qwen3_5_moe`): they differ by name and tiny checkpoint only."""
    return Family(
        name=name,
        read_config=read_config,
        decoder_layer=_no_decoder_layer,
        decoder_stack=None,
        checkpoint_names=Qwen35Names,
        lora_targets=LORA_TARGETS,
        cache_kinds=cache_kinds,
        matmul_params=matmul_params,
        activation_bytes=activation_bytes,
        tiny=tiny,
        tiny_vision=tiny_vision,
        causal_lm=CausalLM,
        state_cache=cache,
        image_batch=image_batch,
    )


def _no_decoder_layer(config: ModelConfig, index: int, options: Any) -> Any:
    raise TypeError(f"{config.arch} builds its whole causal LM (Family.causal_lm), not decoder.CausalLM's layers")


FAMILY = family("qwen3_5", TINY, TINY_VISION)
