"""Gated DeltaNet's depthwise causal conv1d (kernel K = 4, no bias) and SiLU, over [B, T, C] activations, with a
conv state (the K - 1 inputs before the call) in and out.

Written as K shifted multiply-adds rather than `lax.conv`: K is 4, the channels are depthwise, and the shifts make
the two things the layer needs plain masks: a tap that reaches back across a segment start reads zero (packed rows
reset the conv exactly as they reset the delta rule's state; see segments.py), and the state handed on is the
K - 1 inputs ending at each row's last real token, not its padding. One token with a state is the decode step:
the same code, no separate path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .segments import real_length, runs


def causal_conv(
    x: jax.Array,
    weight: jax.Array,
    *,
    segment_ids: jax.Array | None = None,
    state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """SiLU(depthwise causal conv(x)) float32 [B, T, C] and the new state float32 [B, K - 1, C].

    `weight` [C, K] is transformers' `conv1d.weight` [C, 1, K] squeezed: out[t] = sum_i weight[:, i] *
    x[t - (K - 1) + i]. `state` [B, K - 1, C] holds the inputs before x (None: zeros) and continues each row's first
    segment; `segment_ids` [B, T] (None: one sequence, every token real) reset the conv at segment starts."""
    b, t, c = x.shape
    taps = weight.shape[1]
    x = x.astype(jnp.float32)
    w = weight.astype(jnp.float32)
    if state is None:
        state = jnp.zeros((b, taps - 1, c), jnp.float32)
    extended = jnp.concatenate([state.astype(jnp.float32), x], axis=1)  # [B, K - 1 + T, C]
    if segment_ids is None:
        run = jnp.zeros((b, t), jnp.int32)
        length = jnp.full((b,), t, jnp.int32)
    else:
        run, length = runs(segment_ids), real_length(segment_ids)
    run_ext = jnp.concatenate([jnp.zeros((b, taps - 1), jnp.int32), run], axis=1)  # the state continues run 0

    out = jnp.zeros((b, t, c), jnp.float32)
    for i in range(taps):  # static: K taps
        same = (run_ext[:, i : i + t] == run)[..., None]
        out = out + jnp.where(same, extended[:, i : i + t], 0.0) * w[:, i]
    # The inputs at extended positions length .. length + K - 2 (the K - 1 tokens ending at the last real one),
    # those of an earlier run than that token's zeroed.
    window = length[:, None] + jnp.arange(taps - 1)[None, :]  # [B, K - 1]
    last_run = jnp.take_along_axis(run_ext, window[:, -1:], axis=1)
    kept = jnp.take_along_axis(run_ext, window, axis=1) == last_run
    new_state = jnp.where(kept[..., None], jnp.take_along_axis(extended, window[..., None], axis=1), 0.0)
    return jax.nn.silu(out), new_state
