"""Multi-LoRA linear layers: one frozen base kernel plus `max_adapters` LoRA slots, routed per example.

LoRA tensors are `nnx.LoRAParam` (so `nnx.split(model, nnx.LoRAParam, nnx.Param)` separates what is trained from what
is frozen by type, not by name) and carry the adapter axis first: A [S, in, R], B [S, R, out]. Each example gathers
its own slot, so the backward pass scatters an example's gradient into its slot only; an adapter's gradients cannot
depend on another adapter's examples.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from .families import ModuleKind, lora_targets
from .remat import LORA_DOWN, PROJECTION, checkpoint_name

# PEFT's default; scaling = LORA_ALPHA / rank.
LORA_ALPHA = 32.0
# Adapters of a sampler stack computed per loop iteration (_stacked_delta): a stack of up to this many is unrolled
# whole; a larger one loops, so its programs are the size of this one's.
STACK_UNROLL = 4

# The unembedding's LoRA leaves sit under the model's `lm_head` (its export name is a LoRA target: Tinker's
# `unembed_tokens`, checkpoint.py).
UNEMBED_STATE = "lm_head"


@jax.custom_vjp
def base_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w for a frozen base matrix w: x cast to w's dtype, float32 accumulation and output (with float32 weights
    every cast is a no-op).

    The backward pass casts the float32 cotangent to w's dtype as well, so on accelerators dx is one bf16 GEMM with
    float32 accumulation. Left to autodiff, the float32 cotangent met the bf16 weight in a mixed-dtype dot that XLA ran
    as a float32 (TF32) GEMM against an up-cast copy of the weight: on an H100, 27% of a Qwen3-8B LoRA train step."""
    return jnp.matmul(x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _base_matmul_fwd(x: jax.Array, w: jax.Array):
    xc = x.astype(w.dtype)
    # (a size-0 array carries x's dtype: residuals are arrays)
    return jnp.matmul(xc, w, preferred_element_type=jnp.float32), (xc, w, jnp.zeros((0,), x.dtype))


def _base_matmul_bwd(res, g: jax.Array):
    xc, w, like = res
    gc = g.astype(w.dtype)
    dx = jnp.matmul(gc, w.T, preferred_element_type=jnp.float32).astype(like.dtype)
    dw = jnp.einsum("...i,...o->io", xc, gc, preferred_element_type=jnp.float32).astype(w.dtype)  # unused: frozen
    return dx, dw


base_matmul.defvjp(_base_matmul_fwd, _base_matmul_bwd)


@jax.tree_util.register_dataclass
@dataclass
class LoraRouting:
    """Which LoRA slot each example uses and that slot's alpha/rank scaling (zero scale == base model)."""

    adapter: jax.Array  # int32 [B]
    scale: jax.Array  # float32 [B]


@jax.tree_util.register_dataclass
@dataclass
class StackedLoraRouting:
    """Routing for inference over a small stack of adapters (the sampler's snapshots, possibly of several tenants):
    every row multiplies by each adapter of the stack with dense matmuls and keeps only its own adapter's part,
    instead of gathering a per-row copy of A and B ([rows, in, R] per module per step). adapter -1 (or scale 0) is
    the base model."""

    adapter: jax.Array  # int32 [B]; index into the stack's leading axis, -1 = none
    scale: jax.Array  # float32 [B]


def _over_stack(size: int, add, zero: jax.Array) -> jax.Array:
    """zero + each adapter's part (`add(s, out)`), over a stack of `size`: STACK_UNROLL adapters a loop step. Other
    adapters' rows add an exact 0.0."""
    return jax.lax.fori_loop(0, size, add, zero, unroll=min(size, STACK_UNROLL))


def _stacked_delta(x: jax.Array, a: jax.Array, b: jax.Array, routing: StackedLoraRouting) -> jax.Array:
    """Isolated by construction: a foreign adapter's values never reach a row's arithmetic. Each adapter's
    contribution is computed for the whole batch, then *selected* (jnp.where) per row, never multiplied by a zero
    routing weight: NaN * 0 is NaN, so a summed stack would let one tenant's non-finite adapter poison every other
    row (the base model's included). Same FLOPs as one einsum over the stack; the stack is small (snapshots in one
    batch). Stacks past STACK_UNROLL loop over it STACK_UNROLL adapters at a time: unrolled whole, a 16-stack's
    admission compiled in 2.0x a 1-stack's (2.25x scoring), its decode 2.4x, a third of a cold start's background
    warm-up on a 2-core box; looped one adapter at a time, compile times equal a 1-stack's but a decode step's
    delta ran about 1.5x slower on CPU (a microbenchmark on a loaded box: noisy, but never faster)."""
    rows = routing.adapter[:, None, None]  # [B, 1, 1]
    scale = routing.scale[:, None, None]

    def add(s, out):
        keep = rows == s
        h = jnp.where(keep, jnp.matmul(x, a[s], preferred_element_type=jnp.float32) * scale, 0.0)
        return out + jnp.where(keep, jnp.matmul(h, b[s], preferred_element_type=jnp.float32), 0.0)

    return _over_stack(a.shape[0], add, jnp.zeros((*x.shape[:-1], b.shape[-1]), jnp.float32))


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, routing: LoraRouting | StackedLoraRouting) -> jax.Array:
    """scale_b * (x_b @ A[slot_b]) @ B[slot_b] for x [B, T, in]."""
    if isinstance(routing, StackedLoraRouting):
        return _stacked_delta(x, a, b, routing)
    a_rows = a[routing.adapter]  # [B, in, R]
    b_rows = b[routing.adapter]  # [B, R, out]
    h = checkpoint_name(jnp.einsum("bti,bir->btr", x, a_rows), LORA_DOWN)  # kept by Remat.DOTS (remat.py)
    return jnp.einsum("btr,bro->bto", h, b_rows) * routing.scale[:, None, None]


def lora_embedding_delta(
    tokens: jax.Array, a: jax.Array, b: jax.Array, routing: LoraRouting | StackedLoraRouting
) -> jax.Array:
    """The input-side rows of an unembedding LoRA on a tied embedding matrix: [B, T, H] for tokens [B, T].

    With tied embeddings the unembedding LoRA is a low-rank update of the one shared matrix W [V, H]:
    W' = W + scale * (A @ B).T, read by both the output projection (`lora_delta`) and the embedding lookup, whose
    row t gains scale * A @ B[:, t]. That is what merging the adapter into the model means (tinker-cookbook's
    `build_hf_model` adds it to `embed_tokens`), so the service computes the same model as the merged one.
    Only the looked-up columns of B are gathered, never a per-row copy of B [R, V]."""
    if isinstance(routing, StackedLoraRouting):  # select per row, as _stacked_delta, never multiply by zero
        rows, scale = routing.adapter[:, None, None], routing.scale[:, None, None]

        def add(s, out):
            cols = jnp.take(b[s], tokens, axis=1)  # [R, B, T]
            d = jnp.einsum("rbt,hr->bth", cols, a[s], preferred_element_type=jnp.float32)
            return out + jnp.where(rows == s, d * scale, 0.0)

        return _over_stack(a.shape[0], add, jnp.zeros((*tokens.shape, a.shape[1]), jnp.float32))
    cols = b[routing.adapter[:, None], :, tokens]  # [B, T, R]: slot b's B, column tokens[b, t]
    a_rows = a[routing.adapter]  # [B, H, R]
    return jnp.einsum("btr,bhr->bth", cols, a_rows) * routing.scale[:, None, None]


class LoRALinear(nnx.Module):
    """y = x @ W + scale * (x @ A[slot]) @ B[slot]; W stored [in, out] (HF's weight transposed), no bias."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        max_adapters: int,
        max_rank: int,
        rngs: nnx.Rngs,
        param_dtype=jnp.float32,
    ):
        # The base kernel in param_dtype (bf16 on accelerators); LoRA A/B always float32.
        self.kernel = nnx.Param(jnp.zeros((in_features, out_features), param_dtype))
        self.lora_a = nnx.LoRAParam(jnp.zeros((max_adapters, in_features, max_rank), jnp.float32))
        self.lora_b = nnx.LoRAParam(jnp.zeros((max_adapters, max_rank, out_features), jnp.float32))

    def __call__(self, x: jax.Array, routing: LoraRouting) -> jax.Array:
        base = base_matmul(x, self.kernel[...])
        # The projection's output is what Remat.DOTS keeps of this matmul (remat.py says why by name).
        return checkpoint_name(base + lora_delta(x, self.lora_a[...], self.lora_b[...], routing), PROJECTION)


def module_kind(path: tuple) -> ModuleKind:
    """The train_attn/train_mlp/train_unembed group of a LoRA leaf, from its state path: its module's, as the model
    families declare their LoRA targets (families.lora_targets)."""
    targets = lora_targets()
    for key in reversed(path):
        name = getattr(key, "key", getattr(key, "name", key))
        if name == UNEMBED_STATE:
            return "unembed"
        if name in targets:
            return targets[name]
    raise ValueError(f"LoRA parameter at {path} is not under a known target module")


def is_stacked_layer(path: tuple) -> bool:
    """Whether a state path is a leaf of the stacked decoder layers (`layers.self_attn...`, a layer axis inside:
    decoder.DecoderStack) rather than of one layer of a per-layer list (`layers.0.self_attn...`)."""
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    if "layers" not in names:
        return False
    i = names.index("layers")
    return i + 1 < len(names) and not names[i + 1].isdigit()


def is_a_leaf(path: tuple) -> bool:
    return any(getattr(k, "key", getattr(k, "name", k)) == "lora_a" for k in path)


def init_a(rng: np.random.Generator, in_features: int, rank: int, max_rank: int) -> np.ndarray:
    """PEFT's A init: kaiming_uniform(a=sqrt(5)) on the [rank, in] weight, i.e. U(-1/sqrt(in), 1/sqrt(in)).

    Returned as [in, max_rank] with the columns beyond `rank` exactly zero.
    """
    bound = 1.0 / np.sqrt(in_features)
    out = np.zeros((in_features, max_rank), np.float32)
    out[:, :rank] = rng.uniform(-bound, bound, size=(in_features, rank)).astype(np.float32)
    return out
