"""Tiny random Qwen3.5 / Qwen3.5-MoE text models in transformers 5.23 (the reference) and the same weights in ours,
for the test_qwen3_5_* parity tests.

Sizes differ from each other so a transposed or swapped axis cannot pass: hidden 48, 4 layers alternating linear
and full attention (full_attention_interval 2), attention 4 heads on 2 key/value heads of dim 24 (rotary 6 of them,
the default partial_rotary_factor 0.25), Gated DeltaNet 4 value heads of dim 24 on 2 key heads of dim 16. Every
weight is moved away from its init: zero-centred norm weights ~ N(0, 0.3), the gated norm's ~ 1 + N(0, 0.3),
dt_bias ~ N(1, 0.5), A_log spread over transformers' init range U(0.01, 16) (from a state that lasts the whole
sequence to one forgotten within a token), linears ~ N(0, 1 / fan_in): activations of order one, where float32's
rounding stays near 1e-6 and a 1e-5 tolerance can tell a real difference from it (N(0, 0.25) made activations of
~20 whose float32 noise, transformers' own against float64, was 5e-5).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tinkerflow.workers.engine.model.embedding import LMHead
from tinkerflow.workers.engine.model.families.qwen3_5.config import Qwen35Config
from tinkerflow.workers.engine.model.families.qwen3_5.linear_attention import DepthwiseConv
from tinkerflow.workers.engine.model.families.qwen3_5.model import CausalLM
from tinkerflow.workers.engine.model.lora import LoRALinear, LoraRouting
from tinkerflow.workers.engine.model.moe import ExpertLinear, Router

VOCAB, HIDDEN, LAYERS = 96, 48, 4
EXPERTS, TOP_K, MOE_INTER, SHARED_INTER = 8, 2, 16, 20
# Whole-model tolerances: relative L2 error over all logits, and over each token's (test_qwen3_5_layers.py says why)
LOGITS_L2, TOKEN_L2 = 1e-5, 1e-4
A_BY_HEAD = np.array([0.02, 0.2, 1.0, 12.0], np.float32)  # exp(A_log) per value head


def text_config(*, moe: bool = False, tie: bool = False):
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=4,
        full_attention_interval=2,
        tie_word_embeddings=tie,
        rms_norm_eps=1e-6,
        max_position_embeddings=512,
    )
    if moe:
        return transformers.Qwen3_5MoeTextConfig(
            **common,
            num_experts=EXPERTS,
            num_experts_per_tok=TOP_K,
            moe_intermediate_size=MOE_INTER,
            shared_expert_intermediate_size=SHARED_INTER,
        )
    return transformers.Qwen3_5TextConfig(**common, intermediate_size=80)


def hf_model(config, seed: int = 0):
    """transformers' causal LM for `config` in float32, eval mode, eager attention, weights randomised."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cls = transformers.Qwen3_5MoeForCausalLM if hasattr(config, "num_experts") else transformers.Qwen3_5ForCausalLM
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = cls(config).float().eval()
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                value = np.log(A_BY_HEAD * rng.uniform(0.8, 1.25, A_BY_HEAD.shape))
            elif name.endswith("dt_bias"):
                value = rng.normal(1.0, 0.5, p.shape)
            elif name.endswith("linear_attn.norm.weight"):
                value = 1.0 + rng.normal(0.0, 0.3, p.shape)
            elif name.endswith("norm.weight"):
                value = rng.normal(0.0, 0.3, p.shape)
            elif "conv1d" in name or "embed_tokens" in name:
                value = rng.normal(0.0, 0.5, p.shape)
            else:  # linears, experts, router: [..., out, in]
                value = rng.normal(0.0, 1.0 / np.sqrt(p.shape[-1]), p.shape)
            p.copy_(torch.from_numpy(np.asarray(value, np.float32)))
    return model


def our_model(hf, *, max_adapters: int = 2, max_rank: int = 8) -> CausalLM:
    """Our model for transformers' `hf`, its base weights copied by name."""
    config = Qwen35Config.from_hf(hf.config.to_dict())
    model = CausalLM(config, max_adapters=max_adapters, max_rank=max_rank, rngs=nnx.Rngs(0))
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        set_base(model, name.removeprefix("model."), p.detach().numpy())
    return model


def module_at(model, dotted: str):
    node = model
    for part in dotted.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def set_base(model, name: str, value: np.ndarray) -> None:
    """One checkpoint tensor (transformers' name without `model.`) into our module of the same path."""
    path, leaf = name.rsplit(".", 1)
    module = module_at(model, path)
    if leaf == "gate_up_proj":  # experts: [E, 2I, H] -> gate_proj and up_proj kernels [E, H, I]
        half = value.shape[1] // 2
        module.gate_proj.kernel[...] = jnp.asarray(value[:, :half].transpose(0, 2, 1))
        module.up_proj.kernel[...] = jnp.asarray(value[:, half:].transpose(0, 2, 1))
    elif leaf == "down_proj":  # experts: [E, H, I] -> [E, I, H]
        module.down_proj.kernel[...] = jnp.asarray(value.transpose(0, 2, 1))
    elif isinstance(module, LoRALinear | Router | LMHead):
        module.kernel[...] = jnp.asarray(value.T)
    elif isinstance(module, DepthwiseConv):
        module.weight[...] = jnp.asarray(value[:, 0, :])
    else:
        getattr(module, leaf)[...] = jnp.asarray(value)


def lora_modules(model) -> dict[str, LoRALinear | ExpertLinear]:
    """Every module of ours holding LoRA (by dotted path; `lm_head` included)."""
    found = {}
    for path, module in nnx.iter_graph(model):
        if isinstance(module, LoRALinear | ExpertLinear) or (path and path[-1] == "lm_head"):
            found[".".join(str(p) for p in path)] = module
    return found


def routing(b: int, slot: int = 0, scale: float = 0.0) -> LoraRouting:
    return LoraRouting(adapter=jnp.full((b,), slot, jnp.int32), scale=jnp.full((b,), scale, jnp.float32))


def positions(t: int, b: int = 1) -> jnp.ndarray:
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def logits_close(actual, desired, msg: str = "") -> None:
    """The relative L2 error over all logits at most LOGITS_L2 and over each token's logits at most TOKEN_L2."""
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    assert actual.shape == desired.shape, f"{msg}: shapes {actual.shape} and {desired.shape}"
    overall = np.linalg.norm(actual - desired) / np.linalg.norm(desired)
    per_token = np.linalg.norm(actual - desired, axis=-1) / np.linalg.norm(desired, axis=-1)
    assert overall <= LOGITS_L2, f"{msg}: relative L2 error {overall:.2e} over all logits"
    worst = np.unravel_index(np.argmax(per_token), per_token.shape)
    assert per_token.max() <= TOKEN_L2, f"{msg}: relative L2 error {per_token.max():.2e} at token {worst}"
