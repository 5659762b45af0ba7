"""The gated delta rule (families/qwen3_5/gated_delta.py): the chunked form against transformers 5.23's
`torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule` and against our per-token recurrence, packed
segments against each segment alone, resuming from a state, the decode step, gradients, and the backward's memory.

Tolerance: 1e-5 absolute and relative (float32 throughout; the observed differences are ~1e-6 on values of order 1).
Lengths are longer than one chunk (64) and not a multiple of it; value heads outnumber key heads (grouped, as
Qwen3.5's 32 value heads on 16 key heads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tinkerflow.workers.engine.model.families.qwen3_5.gated_delta import (
    chunk_gated_delta_rule,
    gated_delta_step,
    l2_normalize,
    recurrent_gated_delta_rule,
)

TOL = 1e-5
B, T, HK, HV, DK, DV = 2, 150, 2, 4, 16, 24
# exp(A_log) per value head, across transformers' init range U(0.01, 16): from a state that lasts the whole row
# (g ~ -0.01 a token) to one forgotten within a token or two (g ~ -20)
A_BY_HEAD = np.array([0.01, 0.1, 1.0, 16.0], np.float32)


def _close(actual, desired, msg=""):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(desired), atol=TOL, rtol=TOL, err_msg=msg)


def _raw(seed: int = 0, t: int = T) -> dict[str, np.ndarray]:
    """Pre-activation inputs shaped as the layer makes them: q/k on the key heads, a/b per value head."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    return dict(
        q=f(B, t, HK, DK),
        k=f(B, t, HK, DK),
        v=f(B, t, HV, DV),
        a=f(B, t, HV),
        b=f(B, t, HV),
        a_log=np.log(A_BY_HEAD),
        state=f(B, HV, DK, DV),
    )


def _activated(raw: dict):
    """(q, k repeated to the value heads and l2-normalised, v, g, beta) as Qwen3.5's layer computes them."""
    rep = HV // HK
    q = l2_normalize(jnp.repeat(jnp.asarray(raw["q"]), rep, axis=2))
    k = l2_normalize(jnp.repeat(jnp.asarray(raw["k"]), rep, axis=2))
    g = -jnp.exp(raw["a_log"]) * jax.nn.softplus(jnp.asarray(raw["a"]) + 1.0)
    return q, k, jnp.asarray(raw["v"]), g, jax.nn.sigmoid(jnp.asarray(raw["b"]))


def _packed_ids() -> np.ndarray:
    """Row 0: three datums (the second straddles a chunk boundary, the third ends in padding); row 1: right-padded."""
    ids = np.zeros((B, T), np.int32)
    ids[0, :70], ids[0, 70:100], ids[0, 100:140] = 1, 2, 3
    ids[1, : T - 5] = 1
    return ids


@pytest.mark.parity
def test_chunked_and_recurrent_match_transformers():
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    raw = _raw()
    q, k, v, g, beta = _activated(raw)
    t = {name: torch.from_numpy(x) for name, x in raw.items()}
    args = dict(
        g=torch.from_numpy(np.array(g)),
        beta=torch.from_numpy(np.array(beta)),
        initial_state=t["state"],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    ref_out, ref_state = hf.torch_chunk_gated_delta_rule(t["q"], t["k"], t["v"], **args)
    rec_out, rec_state = hf.torch_recurrent_gated_delta_rule(t["q"], t["k"], t["v"], **args)
    _close(rec_out, ref_out, "transformers' two forms agree")

    out, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=jnp.asarray(raw["state"]))
    assert out.shape == (B, T, HV, DV) and state.shape == (B, HV, DK, DV)
    assert float(jnp.abs(out).max()) > 0.1, "outputs too small for the comparison to mean anything"
    _close(out, ref_out.numpy(), "chunked output")
    _close(state, ref_state.numpy(), "chunked final state")
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=jnp.asarray(raw["state"]))
    _close(out, rec_out.numpy(), "recurrent output")
    _close(state, rec_state.numpy(), "recurrent final state")


@pytest.mark.parametrize("chunk", [16, 64, 256])
def test_chunk_sizes_agree_with_the_recurrence(chunk):
    q, k, v, g, beta = _activated(_raw(seed=1))
    ref_out, ref_state = recurrent_gated_delta_rule(q, k, v, g, beta)
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk)
    _close(out, ref_out)
    _close(state, ref_state)


def test_packed_segments_equal_each_segment_alone():
    raw = _raw(seed=2)
    q, k, v, g, beta = _activated(raw)
    ids = _packed_ids()
    init = jnp.asarray(raw["state"])
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, segment_ids=jnp.asarray(ids), initial_state=init)
    rec_out, rec_state = recurrent_gated_delta_rule(q, k, v, g, beta, segment_ids=jnp.asarray(ids), initial_state=init)
    _close(out, rec_out)
    _close(state, rec_state)
    assert np.all(np.asarray(out)[ids == 0] == 0.0), "padding answers exactly zero"
    for row in range(B):
        for seg in range(1, ids[row].max() + 1):
            where = np.flatnonzero(ids[row] == seg)
            lo, hi = where[0], where[-1] + 1
            # the row's first segment continues the initial state; later ones start from zero
            alone_init = init[row : row + 1] if seg == 1 else None
            sl = lambda x: x[row : row + 1, lo:hi]  # noqa: E731, B023
            alone, alone_state = chunk_gated_delta_rule(sl(q), sl(k), sl(v), sl(g), sl(beta), initial_state=alone_init)
            _close(out[row, lo:hi], alone[0], f"row {row} segment {seg}")
            if seg == ids[row].max():
                _close(state[row], alone_state[0], f"row {row}: the final state is its last segment's")


def test_left_padding_and_padding_between_segments_are_no_ops():
    q, k, v, g, beta = _activated(_raw(seed=3))
    ids = np.zeros((B, T), np.int32)
    ids[0, 10:80], ids[0, 90:150] = 1, 2  # left padding, and a gap between the datums
    ids[1, :] = 1
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, segment_ids=jnp.asarray(ids))
    alone, alone_state = chunk_gated_delta_rule(q[:1, 90:], k[:1, 90:], v[:1, 90:], g[:1, 90:], beta[:1, 90:])
    _close(out[0, 90:], alone[0])
    _close(state[0], alone_state[0])
    first, _ = chunk_gated_delta_rule(q[:1, 10:80], k[:1, 10:80], v[:1, 10:80], g[:1, 10:80], beta[:1, 10:80])
    _close(out[0, 10:80], first[0])
    unpacked, unpacked_state = chunk_gated_delta_rule(q[1:], k[1:], v[1:], g[1:], beta[1:])
    _close(out[1], unpacked[0], "a row of one segment is the unpacked computation")
    _close(state[1], unpacked_state[0])


def test_prefill_in_pieces_resumes_from_the_final_state():
    raw = _raw(seed=4)
    q, k, v, g, beta = _activated(raw)
    init = jnp.asarray(raw["state"])
    whole, whole_state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=init)
    state, outs = init, []
    for lo, hi in ((0, 70), (70, 71), (71, 150)):
        out, state = chunk_gated_delta_rule(
            q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], initial_state=state
        )
        outs.append(out)
    _close(jnp.concatenate(outs, axis=1), whole)
    _close(state, whole_state)


def test_decode_steps_equal_the_chunked_form():
    raw = _raw(seed=5, t=70)
    q, k, v, g, beta = _activated(raw)
    state = jnp.asarray(raw["state"])
    whole, whole_state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state)
    step = jax.jit(gated_delta_step)
    for i in range(q.shape[1]):
        out, state = step(state, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i])
        _close(out, whole[:, i], f"token {i}")
    _close(state, whole_state)


def test_gradients_match_the_per_token_recurrence():
    """jax.grad through the chunked form (packed rows, an initial state, the activations in front) equals jax.grad
    through the token-by-token recurrence, for every input."""
    raw = _raw(seed=6)
    ids = jnp.asarray(_packed_ids())
    rng = np.random.default_rng(7)
    co = jnp.asarray(rng.normal(size=(B, T, HV, DV)).astype(np.float32))
    cs = jnp.asarray(rng.normal(size=(B, HV, DK, DV)).astype(np.float32))
    names = ("q", "k", "v", "a", "b", "a_log", "state")

    def loss(form, *xs):
        named = dict(zip(names, xs))
        q, k, v, g, beta = _activated(named)
        out, state = form(q, k, v, g, beta, segment_ids=ids, initial_state=named["state"])
        return jnp.sum(out * co) + jnp.sum(state * cs)

    xs = tuple(jnp.asarray(raw[n]) for n in names)
    argnums = tuple(range(len(names)))
    got = jax.grad(lambda *x: loss(chunk_gated_delta_rule, *x), argnums)(*xs)
    want = jax.grad(lambda *x: loss(recurrent_gated_delta_rule, *x), argnums)(*xs)
    for name, a, b in zip(names, got, want):
        assert float(jnp.abs(b).max()) > 0.01, f"d/d{name} vanishes: the comparison would be empty"
        _close(a, b, f"d/d{name}")


def test_backward_memory_grows_linearly_with_length():
    """The compiled backward's scratch memory at 4x the length is at most 4.25x (quadratic growth would be 16x)."""

    def temp_bytes(t: int) -> int:
        raw = _raw(seed=8, t=t)

        def loss(q, k, v, a, b):
            q, k, v, g, beta = _activated(dict(raw, q=q, k=k, v=v, a=a, b=b))
            out, state = chunk_gated_delta_rule(q, k, v, g, beta)
            return jnp.sum(out) + jnp.sum(state)

        xs = tuple(jnp.asarray(raw[n]) for n in ("q", "k", "v", "a", "b"))
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
        analysis = grad.lower(*xs).compile().memory_analysis()
        if analysis is None:
            pytest.skip("this backend reports no memory analysis")
        return analysis.temp_size_in_bytes

    small, large = temp_bytes(512), temp_bytes(2048)
    assert 0 < large <= 4.25 * small, f"backward scratch {small} B at 512 tokens, {large} B at 2,048"
