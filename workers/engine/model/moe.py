"""The routed-expert block in Flax NNX, with per-expert multi-LoRA: Qwen3-MoE's MLP (families/qwen3_moe/), shared by
any family whose layers route tokens to experts the same way.

Names mirror the Hugging Face checkpoint (`layers[i].mlp.gate` is the router, `layers[i].mlp.experts.gate_proj` ...),
but the experts are stacked: one kernel [E, in, out] per projection instead of E separate linears, so the loader
fills expert e's slice from `mlp.experts.{e}.gate_proj.weight`.

The computation is grouped by expert, never a loop over experts: every (token, chosen expert) pair is sorted by
expert, and each projection is one grouped matmul over the sorted rows (`grouped_matmul`: `jax.lax.ragged_dot` on
GPU/TPU, where XLA has a native kernel; on CPU, whose ragged_dot lowering expands the rows to a dense
[E, rows, in] tensor, the sorted rows are cut into fixed-size blocks that each belong to one expert and the blocks
are multiplied one expert matrix at a time, so the work is the rows' and not E times that).

LoRA on experts (PEFT's per-expert adapters, as on transformers 4's `experts.{e}.gate_proj` linears): A [S, E, in, R]
and B [S, E, R, out], the adapter axis leading as for dense layers. All S adapters of an expert are applied to its
rows as one [in, S*R] matmul and each row keeps only its own adapter's R columns (`jnp.where`, so another adapter's
values, even non-finite ones, never enter and its gradient from this row is exactly zero). The router has no LoRA:
it stays frozen, as PEFT leaves it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .families import ModelConfig
from .lora import LoraRouting, StackedLoraRouting
from .remat import LORA_DOWN, PROJECTION, checkpoint_name


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _blocked_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Exact ragged_dot for rows sorted by group, as a scan over row blocks that each belong to a single group."""
    m, k = x.shape
    g, _, n = w.shape
    block = min(max(_pow2(-(-m // g)), 8), 128)  # about one block per group on average, static at trace time
    n_blocks = -(-m // block) + g  # each group wastes less than one block
    sizes = group_sizes.astype(jnp.int32)
    padded = -(-sizes // block) * block
    ends, pad_ends = jnp.cumsum(sizes), jnp.cumsum(padded)
    starts, pad_starts = ends - sizes, pad_ends - padded
    rows = jnp.arange(m, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), g - 1)
    dest = pad_starts[row_group] + rows - starts[row_group]  # each sorted row's place in the padded layout
    xp = jnp.zeros((n_blocks * block, k), x.dtype).at[dest].set(x)
    block_group = jnp.minimum(jnp.searchsorted(pad_ends, jnp.arange(n_blocks) * block, side="right"), g - 1)

    def one(args):
        xb, gi = args
        return jnp.matmul(xb, w[gi], preferred_element_type=jnp.float32)

    out = jax.lax.map(one, (xp.reshape(n_blocks, block, k), block_group))
    return out.reshape(n_blocks * block, n)[dest]


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """x [M, in] sorted by group (group_sizes [G] summing to M) times w [G, in, out] -> float32 [M, out].

    x is cast to w's dtype, accumulation is float32 (as `model.matmul`)."""
    x = x.astype(w.dtype)
    if jax.default_backend() == "cpu":
        return _blocked_grouped_matmul(x, w, group_sizes)
    return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32)


class Router(nnx.Module):
    """mlp.gate: logits = x @ W [H, E] (HF's weight [E, H] transposed); frozen (no LoRA)."""

    def __init__(self, config: ModelConfig, param_dtype=jnp.float32):
        self.kernel = nnx.Param(jnp.zeros((config.hidden_size, config.num_experts), param_dtype))
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(router logits [N, E], weights [N, K], experts [N, K]) for x [N, H], as Qwen3MoeTopKRouter: softmax in
        float32, top-k of the probabilities, renormalised over the k when norm_topk_prob."""
        logits = jnp.matmul(x.astype(self.kernel[...].dtype), self.kernel[...], preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return logits, weights, experts


class ExpertLinear(nnx.Module):
    """E stacked linears (kernel [E, in, out], no bias) with per-expert LoRA slots A [S, E, in, R], B [S, E, R, out]."""

    def __init__(
        self,
        experts: int,
        in_features: int,
        out_features: int,
        *,
        max_adapters: int,
        max_rank: int,
        param_dtype=jnp.float32,
    ):
        self.kernel = nnx.Param(jnp.zeros((experts, in_features, out_features), param_dtype))
        self.lora_a = nnx.LoRAParam(jnp.zeros((max_adapters, experts, in_features, max_rank), jnp.float32))
        self.lora_b = nnx.LoRAParam(jnp.zeros((max_adapters, experts, max_rank, out_features), jnp.float32))

    def __call__(self, xs: jax.Array, sizes: jax.Array, keep: jax.Array, scale: jax.Array) -> jax.Array:
        """xs [M, in] sorted by expert; keep [M, S] one-hot of each row's adapter (all False = base); scale [M]."""
        base = grouped_matmul(xs, self.kernel[...], sizes)
        a, b = self.lora_a[...], self.lora_b[...]
        s, e, i, r = a.shape
        a_all = jnp.transpose(a, (1, 2, 0, 3)).reshape(e, i, s * r)  # every adapter of expert e side by side
        b_all = jnp.transpose(b, (1, 0, 2, 3)).reshape(e, s * r, b.shape[-1])
        h = grouped_matmul(xs.astype(jnp.float32), a_all, sizes).reshape(-1, s, r)
        h = jnp.where(keep[:, :, None], checkpoint_name(h, LORA_DOWN) * scale[:, None, None], 0.0)
        # What Remat.DOTS keeps of the experts' matmuls, as of a dense projection (lora.LoRALinear, remat.py).
        return checkpoint_name(base + grouped_matmul(h.reshape(-1, s * r), b_all, sizes), PROJECTION)


class Experts(nnx.Module):
    def __init__(self, config: ModelConfig, *, max_adapters: int, max_rank: int, param_dtype=jnp.float32):
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        kw = dict(max_adapters=max_adapters, max_rank=max_rank, param_dtype=param_dtype)
        self.gate_proj = ExpertLinear(e, h, i, **kw)
        self.up_proj = ExpertLinear(e, h, i, **kw)
        self.down_proj = ExpertLinear(e, i, h, **kw)


def _row_adapters(routing: LoraRouting | StackedLoraRouting, slots: int) -> tuple[jax.Array, jax.Array]:
    """Per batch row: one-hot [B, S] of its adapter (none for the base model) and its scale [B]."""
    keep = routing.adapter[:, None] == jnp.arange(slots)[None, :]
    keep = keep & (routing.scale[:, None] != 0)
    return keep, routing.scale.astype(jnp.float32)


class SparseMoeBlock(nnx.Module):
    """Qwen3MoeSparseMoeBlock: route each token to its top-k experts and sum their SwiGLU outputs, weighted."""

    def __init__(self, config: ModelConfig, *, max_adapters: int, max_rank: int, param_dtype=jnp.float32):
        self.config = config
        self.gate = Router(config, param_dtype)
        self.experts = Experts(config, max_adapters=max_adapters, max_rank=max_rank, param_dtype=param_dtype)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The router's (logits, weights, experts) for x [B, T, H], flattened over tokens."""
        return self.gate(x.reshape(-1, x.shape[-1]))

    def __call__(self, x: jax.Array, routing: LoraRouting | StackedLoraRouting) -> jax.Array:
        b, t, hdim = x.shape
        k, n_exp = self.config.num_experts_per_tok, self.config.num_experts
        xf = x.reshape(b * t, hdim)
        _, weights, experts = self.gate(xf)
        flat = experts.reshape(-1)  # [N*K], pair p is token p // k
        order = jnp.argsort(flat, stable=True)
        token = order // k
        sizes = jnp.bincount(flat, length=n_exp)
        keep, scale = _row_adapters(routing, self.experts.gate_proj.lora_a.shape[0])
        row = token // t
        keep, scale = keep[row], scale[row]
        xs = xf[token]
        ex = self.experts
        act = jax.nn.silu(ex.gate_proj(xs, sizes, keep, scale)) * ex.up_proj(xs, sizes, keep, scale)
        out = ex.down_proj(act, sizes, keep, scale) * weights.reshape(-1)[order][:, None]
        return jnp.zeros((b * t, hdim), jnp.float32).at[token].add(out).reshape(b, t, hdim)
