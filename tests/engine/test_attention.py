"""Attention with memory linear in length against the materialised attention it replaced (kept as the reference):
outputs and gradients at float32 1e-5, for ragged rows, packed segments, grouped-query heads, a cached prefix
(q_offset), several block sizes; decoding against the reference at one position; and whole models (Qwen3, Llama 3,
Qwen3-MoE): logits, loss and LoRA gradients equal whichever attention runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from moe_checkpoint import build_moe_model
from test_training import assert_grads_close

from tinkerflow.workers.engine.model.attention import reference_attention, select
from tinkerflow.workers.engine.model.blockwise_attention import blockwise_attention
from tinkerflow.workers.engine.model.cached_attention import decode_attention

# Both paths run in float32 and differ only in the order of their sums: 1e-5 of each tensor's scale, and at least of
# the inputs' (standard normal: 1), since a gradient that is exactly zero in one (a query that sees one key) is a
# rounding residue of 1e-7 in the other.
TOL = 1e-5


def _close(actual, desired, what: str) -> None:
    scale = max(float(jnp.max(jnp.abs(desired))), 1.0)
    np.testing.assert_allclose(np.asarray(actual), np.asarray(desired), rtol=TOL, atol=TOL * scale, err_msg=what)


def _segments(rng: np.random.Generator, b: int, t: int, packed: bool) -> np.ndarray:
    """Rows of random real lengths (right padding 0); packed rows cut into 1..4 datums with rising ids."""
    seg = np.zeros((b, t), np.int32)
    for r in range(b):
        n = int(rng.integers(1, t + 1))
        if packed and n > 1:
            cuts = np.sort(rng.choice(np.arange(1, n), size=min(3, n - 1), replace=False))
            seg[r, :n] = 1 + np.searchsorted(cuts, np.arange(n), side="right")
        else:
            seg[r, :n] = 1
    return seg


def _case(rng, b, t, heads, kv, d, s=None):
    s = s or t
    q = jnp.asarray(rng.normal(size=(b, t, heads, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, s, kv, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, s, kv, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(b, t, heads, d)), jnp.float32)
    return q, k, v, w


def _check(q, k, v, w, qs, ks, offset, block):
    real = (qs > 0)[:, :, None, None]

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.where(real, fn(q, k, v) * w, 0.0))

    ref = lambda q, k, v: reference_attention(q, k, v, qs, ks, q_offset=offset)  # noqa: E731
    blk = lambda q, k, v: blockwise_attention(q, k, v, qs, ks, q_offset=offset, block_q=block, block_k=block)  # noqa: E731
    out_ref, out_blk = ref(q, k, v), jax.jit(blk)(q, k, v)
    _close(jnp.where(real, out_blk, 0), jnp.where(real, out_ref, 0), "attention output")
    assert not np.any(np.asarray(jnp.where(real, 0.0, out_blk))), "padding queries must answer exactly zero"
    g_ref = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v)
    g_blk = jax.jit(jax.grad(loss(blk), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", g_blk, g_ref):
        _close(a, b, f"d{name}")


@pytest.mark.parametrize(
    "b,t,heads,kv,block,packed",
    [
        (2, 64, 4, 2, 16, False),
        (2, 64, 4, 2, 16, True),
        (3, 100, 4, 1, 32, True),
        (1, 37, 2, 2, 256, True),
        (2, 96, 8, 8, 32, True),
    ],
)
def test_blockwise_equals_reference_with_gradients(b, t, heads, kv, block, packed):
    rng = np.random.default_rng(t + block)
    q, k, v, w = _case(rng, b, t, heads, kv, 16)
    seg = jnp.asarray(_segments(rng, b, t, packed))
    _check(q, k, v, w, seg, seg, 0, block)


def test_blockwise_with_a_cached_prefix_equals_reference():
    """Queries as the suffix of rows whose first keys are already cached (q_offset)."""
    rng = np.random.default_rng(7)
    q, k, v, w = _case(rng, 2, 48, 4, 2, 16, s=64)
    kseg = jnp.asarray(_segments(rng, 2, 64, True))
    _check(q, k, v, w, kseg[:, 16:], kseg, 16, 16)


@settings(max_examples=15, deadline=None)
@given(
    t=st.integers(1, 80),
    block=st.sampled_from([8, 16, 32]),
    packed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_blockwise_equals_reference_for_any_layout(t, block, packed, seed):
    rng = np.random.default_rng(seed)
    q, k, v, w = _case(rng, 2, t, 4, 2, 8)
    seg = jnp.asarray(_segments(rng, 2, t, packed))
    _check(q, k, v, w, seg, seg, 0, block)


def test_decoding_reads_filled_blocks_only_and_equals_reference():
    """One query per row at its own position against a cache longer than any row has filled; the entries past a row's
    position hold NaN (a previous occupant's values) and must not reach its answer."""
    rng = np.random.default_rng(3)
    layers, b, s, kv, d, heads = 2, 3, 1024, 2, 16, 4
    k = np.asarray(rng.normal(size=(layers, b, s, kv, d)), np.float32)
    v = np.asarray(rng.normal(size=(layers, b, s, kv, d)), np.float32)
    pos = np.array([5, 700, 1023])
    for r, p in enumerate(pos):
        k[:, r, p + 1 :], v[:, r, p + 1 :] = np.nan, np.nan
    q = jnp.asarray(rng.normal(size=(b, 1, heads, d)), jnp.float32)
    out = decode_attention(q, jnp.asarray(k), jnp.asarray(v), 1, jnp.asarray(pos), block=256)
    assert np.all(np.isfinite(np.asarray(out)))
    for r, p in enumerate(pos):
        seg = jnp.asarray((np.arange(p + 1) >= 0)[None].astype(np.int32))
        kr, vr = jnp.asarray(k[1, r : r + 1, : p + 1]), jnp.asarray(v[1, r : r + 1, : p + 1])
        ref = reference_attention(q[r : r + 1], kr, vr, seg[:, -1:], seg, q_offset=int(p))
        _close(out[r : r + 1, 0], ref.reshape(1, -1), f"row {r}")


def test_selection_by_backend():
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert select(f32, single_segment=True, backend="cpu") == "blockwise"
    assert select(bf16, single_segment=True, backend="gpu") == "cudnn"
    assert select(bf16, single_segment=False, backend="gpu") == "pallas_gpu"
    assert select(f32, single_segment=True, backend="gpu") == "pallas_gpu"  # cuDNN's fused kernel is bf16/fp16
    assert select(bf16, single_segment=False, backend="tpu") == "pallas_tpu"


def test_an_unknown_forced_implementation_is_refused(monkeypatch):
    monkeypatch.setenv("TINKERFLOW_ATTENTION", "flash3")
    with pytest.raises(ValueError, match="TINKERFLOW_ATTENTION='flash3'"):
        select(jnp.float32, single_segment=True)


# --------------------------------------------------------------------------------------------- whole models


def _model_numbers(model_dir, monkeypatch, implementation: str):
    """Per-token logprobs and the LoRA gradient of a ragged two-datum batch, with `implementation` forced."""
    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, ForwardBackwardResult, LoraConfig

    monkeypatch.setenv("TINKERFLOW_ATTENTION", implementation)
    engine = Engine.load(str(model_dir), max_lora_adapters=2, max_lora_rank=4, progress=False)
    engine.create_adapter(0, LoraConfig(rank=4, seed=5))
    rng = np.random.default_rng(11)
    data = []
    for n in (29, 17, 8):  # packed into one row of two segments and more
        s = rng.integers(1, 250, n + 1).astype(np.int32)
        data.append(Datum(tokens=s[:-1], inputs={"target_tokens": s[1:]}))
    [res] = engine.forward_backward([ForwardBackwardInput(slot=0, data=data, loss_fn="cross_entropy")])
    assert isinstance(res, ForwardBackwardResult), res
    return [o["logprobs"] for o in res.outputs], res.metrics["loss:sum"], engine.accumulated_grads(0)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_models_give_the_same_numbers_with_either_attention(arch, tmp_path, make_checkpoint, monkeypatch):
    build = build_moe_model if arch == "qwen3_moe" else lambda d: make_checkpoint(d, arch=arch)
    model_dir = build(tmp_path / arch)
    ref_lp, ref_loss, ref_grads = _model_numbers(model_dir, monkeypatch, "reference")
    blk_lp, blk_loss, blk_grads = _model_numbers(model_dir, monkeypatch, "blockwise")
    for a, b in zip(blk_lp, ref_lp):
        np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)
    np.testing.assert_allclose(blk_loss, ref_loss, rtol=TOL)
    assert_grads_close(blk_grads, ref_grads)


def test_the_settings_field_offers_exactly_the_implementations():
    from tinkerflow.common.settings import config_fields
    from tinkerflow.workers.engine.model.attention import IMPLEMENTATIONS

    field = next(f for f in config_fields() if f.name == "attention")
    assert tuple(field.metadata["choices"]) == IMPLEMENTATIONS
