"""Gated DeltaNet's causal conv (families/qwen3_5/conv.py) against transformers 5.23's `causal_conv1d_fn` and
`causal_conv1d_update` (torch's depthwise conv1d), packed segments against each segment alone, and the conv state
carried through prefill pieces and single-token decoding. Tolerance 1e-5 absolute and relative (float32)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tinkerflow.workers.engine.model.families.qwen3_5.conv import causal_conv

TOL = 1e-5
B, T, C, K = 2, 21, 12, 4


def _close(actual, desired, msg=""):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(desired), atol=TOL, rtol=TOL, err_msg=msg)


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    return (
        rng.normal(size=(B, T, C)).astype(np.float32),
        rng.normal(size=(C, K)).astype(np.float32) * 0.5,
        rng.normal(size=(B, K - 1, C)).astype(np.float32),
    )


@pytest.mark.parity
def test_matches_transformers_prefill_and_update():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    x, w, state = _inputs()
    ref = hf.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w), None, activation="silu")
    out, new_state = causal_conv(jnp.asarray(x), jnp.asarray(w))
    _close(out, ref.transpose(1, 2).numpy(), "prefill from an empty state")
    _close(new_state, x[:, -(K - 1) :], "the state is the last K - 1 inputs")

    conv_state = torch.from_numpy(state).transpose(1, 2).contiguous()  # transformers keeps [B, C, K - 1]
    ours = jnp.asarray(state)
    for i in range(4):
        token = torch.from_numpy(x[:, i : i + 1]).transpose(1, 2)
        ref = hf.causal_conv1d_update(token, conv_state, torch.from_numpy(w), None, activation="silu")
        out, ours = causal_conv(jnp.asarray(x[:, i : i + 1]), jnp.asarray(w), state=ours)
        _close(out, ref.transpose(1, 2).numpy(), f"decode step {i}")
        _close(ours, conv_state.transpose(1, 2).numpy(), f"state after step {i}")


def test_pieces_and_steps_equal_one_call():
    x, w, state = (jnp.asarray(a) for a in _inputs(1))
    whole, whole_state = causal_conv(x, w, state=state)
    outs, s = [], state
    for lo, hi in ((0, 2), (2, 3), (3, 11), (11, T)):  # a piece shorter than K - 1 included
        out, s = causal_conv(x[:, lo:hi], w, state=s)
        outs.append(out)
    _close(jnp.concatenate(outs, axis=1), whole)
    _close(s, whole_state)


def test_packed_segments_equal_each_segment_alone():
    x, w, state = (jnp.asarray(a) for a in _inputs(2))
    ids = np.zeros((B, T), np.int32)
    ids[0, :8], ids[0, 8:10], ids[0, 10:12] = 1, 2, 3  # datums shorter than the kernel, then right padding
    ids[1, 2:12], ids[1, 14:] = 1, 2  # left padding and a gap
    x = x * (ids > 0)[..., None]  # the layer zeroes padding's inputs before the conv (as transformers does)
    out, new_state = causal_conv(x, w, segment_ids=jnp.asarray(ids), state=state)
    for row in range(B):
        for seg in range(1, ids[row].max() + 1):
            where = np.flatnonzero(ids[row] == seg)
            lo, hi = where[0], where[-1] + 1
            # the state continues the row's first segment (through its left padding); later ones start from zero
            start, init = (0, state[row : row + 1]) if seg == 1 else (lo, None)
            alone, alone_state = causal_conv(x[row : row + 1, start:hi], w, state=init)
            _close(out[row, lo:hi], alone[0, lo - start :], f"row {row} segment {seg}")
            if seg == ids[row].max():
                _close(new_state[row], alone_state[0], f"row {row}: the state ends at the last real token")
