"""Engine options that must not change the numbers (gradient checkpointing) or change them only within bf16's
precision (bfloat16 base weights with float32 accumulation), both on this CPU."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import MAX_ADAPTERS, MAX_RANK
from test_training import assert_grads_close

from tinkerflow.workers.engine.engine import Engine
from tinkerflow.workers.engine.model.dtypes import default_dtype
from tinkerflow.workers.engine.types import AdamConfig, Datum, ForwardBackwardInput, LoraConfig

# bf16 keeps 8 bits of mantissa: logprobs of the tiny model (down to about -12) move by up to ~0.05.
BF16_ATOL, BF16_RTOL = 5e-2, 2e-2


def _batch(rng, forward_only=False):
    data = []
    for n in (13, 9):
        s = rng.integers(1, 300, n).astype(np.int32)
        data.append(Datum(tokens=s[:-1], inputs={"target_tokens": s[1:]}))
    return ForwardBackwardInput(slot=0, data=data, loss_fn="cross_entropy", forward_only=forward_only)


def _load(qwen3_dir, **kw) -> Engine:
    return Engine.load(str(qwen3_dir), max_lora_adapters=MAX_ADAPTERS, max_lora_rank=MAX_RANK, progress=False, **kw)


def test_default_dtype_is_float32_on_cpu(engine):
    assert default_dtype() == np.float32 and engine.dtype == np.float32


def test_gradient_checkpointing_gives_the_same_grads(engine, qwen3_dir):
    remat = _load(qwen3_dir, gradient_checkpointing=True)
    results, grads = [], []
    for e in (engine, remat):
        e.create_adapter(0, LoraConfig(rank=4, seed=1))
        [res] = e.forward_backward([_batch(np.random.default_rng(3))])
        results.append(res)
        grads.append(e.accumulated_grads(0))
    assert_grads_close(grads[1], grads[0])
    for a, b in zip(results[0].outputs, results[1].outputs):
        np.testing.assert_allclose(b["logprobs"], a["logprobs"], rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def bf16(qwen3_dir) -> Engine:
    return _load(qwen3_dir, dtype="bfloat16")


def test_bfloat16_weights_stay_close_to_float32_and_train(engine, bf16):
    assert bf16.dtype == np.dtype("bfloat16")
    assert {str(x.dtype) for x in _leaves(bf16._base)} == {"bfloat16", "float32"}  # matrices bf16, norms float32
    assert {
        str(x.dtype) for x in _leaves(bf16.adapters.lora) + _leaves(bf16.adapters.opt.mu) + _leaves(bf16.adapters.grads)
    } == {"float32"}

    # The first training call's logprobs (before any step) against float32's; one compile per engine.
    first = []
    for e in (engine, bf16):
        e.create_adapter(0, LoraConfig(rank=4, seed=1))
        [res] = e.forward_backward([_batch(np.random.default_rng(4))])
        assert all(o["logprobs"].dtype == np.float32 for o in res.outputs)
        first.append(res)
    lps = [np.concatenate([o["logprobs"] for o in r.outputs]) for r in first]
    np.testing.assert_allclose(lps[1], lps[0], atol=BF16_ATOL, rtol=BF16_RTOL)
    assert not np.array_equal(lps[1], lps[0]), "the bf16 path should really run in bf16"

    losses = [first[1].metrics["loss:sum"]]
    for _ in range(3):
        bf16.optim_step(0, AdamConfig(learning_rate=1e-2))
        [res] = bf16.forward_backward([_batch(np.random.default_rng(4))])
        losses.append(res.metrics["loss:sum"])
    assert losses[-1] < 0.6 * losses[0], losses


@pytest.mark.slow
def test_bfloat16_sampler_logprobs_equal_trainer_logprobs(bf16):
    """Sampling in bf16 (the KV cache in bf16) reports the trainer's logprobs for the same weights."""
    from tinkerflow.workers.engine.types import SampleInput

    bf16.create_adapter(0, LoraConfig(rank=4, seed=1))
    bf16.forward_backward([_batch(np.random.default_rng(4))])
    bf16.optim_step(0, AdamConfig(learning_rate=1e-2))
    bf16.snapshot(0, "bf16")
    prompt = np.array([5, 17, 42, 99, 3], np.int32)
    [sampled] = bf16.sample(
        [SampleInput(prompt=prompt, max_tokens=6, temperature=0.0, stop_token_ids=[], snapshot="bf16")]
    )
    seq = sampled.sequences[0]
    full = np.concatenate([prompt, seq.tokens]).astype(np.int32)
    [ref] = bf16.forward_backward(
        [
            ForwardBackwardInput(
                slot=0, data=[Datum(full[:-1], {"target_tokens": full[1:]})], loss_fn="cross_entropy", forward_only=True
            )
        ]
    )
    np.testing.assert_allclose(seq.logprobs, ref.outputs[0]["logprobs"][len(prompt) - 1 :], atol=1e-2)


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


@pytest.mark.parametrize("bad", ["int8", "float16x"])
def test_bad_dtype_is_refused(qwen3_dir, bad):
    with pytest.raises((TypeError, ValueError)):
        _load(qwen3_dir, dtype=bad)
