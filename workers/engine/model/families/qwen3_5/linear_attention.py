"""Qwen3.5's linear-attention layer, Gated DeltaNet (transformers' `Qwen3_5GatedDeltaNet`), in Flax NNX with
multi-LoRA on its five linears (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, `out_proj`).

    qkv = silu(causal_conv(in_proj_qkv(x)))       -> q, k [.., key heads, dk], v [.., value heads, dv]
    q, k = l2norm(q), l2norm(k), repeated to the value heads (each key head serves consecutive value heads)
    g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias);  beta = sigmoid(in_proj_b(x))
    out = out_proj(gated_rmsnorm(gated_delta_rule(q, k, v, g, beta), z = in_proj_z(x)))

Its state between calls is `LinearAttentionState`: the conv's last K - 1 inputs and the delta rule's [H, dk, dv]
matrix per row, fixed in size whatever the length. A call with `state` continues it (a prompt prefilled in pieces,
decoding, a snapshot resumed) and every call returns the state after each row's last real token. One token per row
with a state takes the single-step recurrence; anything longer the chunked form (gated_delta.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from ...attention import Segments
from ...lora import LoRALinear, LoraRouting
from .config import Qwen35Config
from .conv import causal_conv
from .gated_delta import chunk_gated_delta_rule, gated_delta_step, l2_normalize
from .layers import GatedRMSNorm, lora_kwargs


class LinearAttentionState(NamedTuple):
    """One Gated DeltaNet layer's state per row: `conv` float32 [B, K - 1, conv_dim] (the conv's last inputs) and
    `recurrent` float32 [B, value heads, dk, dv]."""

    conv: jax.Array
    recurrent: jax.Array


def empty_state(config: Qwen35Config, batch: int) -> LinearAttentionState:
    c = config
    return LinearAttentionState(
        conv=jnp.zeros((batch, c.linear_conv_kernel_dim - 1, c.conv_dim), jnp.float32),
        recurrent=jnp.zeros(
            (batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim), jnp.float32
        ),
    )


class DepthwiseConv(nnx.Module):
    """`conv1d`: weight [channels, K], transformers' [channels, 1, K] squeezed (no bias)."""

    def __init__(self, channels: int, taps: int, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.zeros((channels, taps), param_dtype))


class GatedDeltaNet(nnx.Module):
    def __init__(
        self, config: Qwen35Config, *, max_adapters: int, max_rank: int, rngs: nnx.Rngs, param_dtype=jnp.float32
    ):
        self.config = config
        c, h, nv = config, config.hidden_size, config.linear_num_value_heads
        lora = lora_kwargs(max_adapters, max_rank, rngs, param_dtype)
        self.in_proj_qkv = LoRALinear(h, c.conv_dim, **lora)
        self.in_proj_z = LoRALinear(h, c.linear_value_dim, **lora)
        self.in_proj_b = LoRALinear(h, nv, **lora)
        self.in_proj_a = LoRALinear(h, nv, **lora)
        self.conv1d = DepthwiseConv(c.conv_dim, c.linear_conv_kernel_dim, param_dtype)
        # Per-head decay parameters stay float32 (transformers computes the gate from A_log.float()).
        self.dt_bias = nnx.Param(jnp.ones((nv,), jnp.float32))
        self.A_log = nnx.Param(jnp.zeros((nv,), jnp.float32))
        self.norm = GatedRMSNorm(c.linear_value_head_dim, c.rms_norm_eps)
        self.out_proj = LoRALinear(c.linear_value_dim, h, **lora)

    def __call__(
        self,
        x: jax.Array,
        routing: LoraRouting,
        segments: Segments | None = None,
        state: LinearAttentionState | None = None,
    ) -> tuple[jax.Array, LinearAttentionState]:
        """x [B, T, hidden] -> (float32 [B, T, hidden], the state after each row's last real token).
        `segments`: packed rows (None: each row one sequence, every token real); the state resets at each segment
        start, and `state` (None: zeros) continues each row's first segment."""
        c = self.config
        b, t, _ = x.shape
        ids = None if segments is None else segments.ids
        if ids is not None:  # padding's inputs are zero, as transformers' apply_mask_to_padding_states
            x = jnp.where((ids > 0)[..., None], x, jnp.zeros((), x.dtype))
        conv_state = None if state is None else state.conv
        qkv, conv_state = causal_conv(
            self.in_proj_qkv(x, routing), self.conv1d.weight[...], segment_ids=ids, state=conv_state
        )
        kd = c.linear_key_dim
        rep = c.linear_num_value_heads // c.linear_num_key_heads
        q = jnp.repeat(qkv[..., :kd].reshape(b, t, c.linear_num_key_heads, -1), rep, axis=2)
        k = jnp.repeat(qkv[..., kd : 2 * kd].reshape(b, t, c.linear_num_key_heads, -1), rep, axis=2)
        v = qkv[..., 2 * kd :].reshape(b, t, c.linear_num_value_heads, -1)
        q, k = l2_normalize(q), l2_normalize(k)
        beta = jax.nn.sigmoid(self.in_proj_b(x, routing))
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(self.in_proj_a(x, routing) + self.dt_bias[...])

        recurrent = None if state is None else state.recurrent
        if t == 1 and recurrent is not None:
            before = recurrent
            out, recurrent = gated_delta_step(before, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
            out = out[:, None]
            if ids is not None:  # a padding token leaves the state as it was and answers zero
                real = ids[:, 0] > 0
                recurrent = jnp.where(real[:, None, None, None], recurrent, before)
                out = jnp.where(real[:, None, None, None], out, 0.0)
        else:
            out, recurrent = chunk_gated_delta_rule(q, k, v, g, beta, segment_ids=ids, initial_state=recurrent)
        z = self.in_proj_z(x, routing).reshape(b, t, c.linear_num_value_heads, -1)
        out = self.norm(out, z).reshape(b, t, c.linear_value_dim)
        return self.out_proj(out, routing), LinearAttentionState(conv_state, recurrent)
