"""Qwen3-MoE's answers: model/'s decoder layer with q/k norm and, per layer, the routed experts or the dense MLP (so
its layers are not stacked for the scan), its per-expert checkpoint names, and costs that count a token's top-k
experts only."""

from __future__ import annotations

from ...decoder import DECODER_TARGETS, MLP, DecoderLayer, kv_every_layer
from ...layer_costs import decoder_params, layer_activation_bytes, swiglu_params
from ...moe import SparseMoeBlock
from .. import Family, LayerOptions, ModelConfig
from .checkpoint import ExpertNames
from .config import read_config
from .tiny import TINY


def decoder_layer(config: ModelConfig, index: int, options: LayerOptions) -> DecoderLayer:
    mlp: SparseMoeBlock | MLP
    if config.is_moe_layer(index):
        o = options
        mlp = SparseMoeBlock(config, max_adapters=o.max_adapters, max_rank=o.max_rank, param_dtype=o.param_dtype)
    else:
        mlp = MLP(config, **options.kwargs())
    return DecoderLayer(config, mlp, **options.kwargs())


def matmul_params(c: ModelConfig) -> int:
    """A sparse layer's MLP: the top-k experts' SwiGLU k·3·H·I_moe and the router H·E."""
    routed = (
        c.num_experts_per_tok * swiglu_params(c.hidden_size, c.moe_intermediate_size) + c.hidden_size * c.num_experts
    )
    dense = swiglu_params(c.hidden_size, c.intermediate_size)
    return decoder_params(c, lambda i: routed if c.is_moe_layer(i) else dense)


def activation_bytes(c: ModelConfig, compute_bytes: int, max_rank: int) -> int:
    """The widest MLP a token goes through: its top-k experts', or a dense layer's where there is one (the router's
    logits are small)."""
    dense = c.intermediate_size if len(c.moe_layers) < c.num_layers else 0
    width = max(dense, c.moe_intermediate_size * c.num_experts_per_tok)
    return layer_activation_bytes(c, width, compute_bytes, max_rank)


FAMILY = Family(
    name="qwen3_moe",
    read_config=read_config,
    decoder_layer=decoder_layer,
    decoder_stack=None,
    checkpoint_names=ExpertNames,
    lora_targets=DECODER_TARGETS,
    cache_kinds=kv_every_layer,
    matmul_params=matmul_params,
    activation_bytes=activation_bytes,
    tiny=TINY,
)
