"""Training semantics: fresh adapter == base, isolation between adapters, masks, padding, micro-batching, validation."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tinkerflow.workers.engine.types import AdamConfig, Datum, ForwardBackwardInput, InputError, LoraConfig

ADAM = AdamConfig(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0)


def ce(slot, seqs, *, forward_only=False, weights=None):
    data = []
    for s in seqs:
        s = np.asarray(s, np.int32)
        inputs: dict[str, np.ndarray] = {"target_tokens": s[1:]}
        if weights is not None:
            inputs["weights"] = np.full(len(s) - 1, weights, np.float32)
        data.append(Datum(tokens=s[:-1], inputs=inputs))
    return ForwardBackwardInput(slot=slot, data=data, loss_fn="cross_entropy", forward_only=forward_only)


def seqs(rng, n, length):
    return [rng.integers(1, 300, size=length) for _ in range(n)]


def snapshot_state(engine, slot):
    return engine.adapter_weights(slot), engine.accumulated_grads(slot)


def assert_grads_close(actual, desired):
    """Gradients are float32 sums whose order changes with batch layout: compare to 1e-5 of each tensor's scale."""
    assert actual.keys() == desired.keys()
    for k in desired:
        scale = float(np.abs(desired[k]).max())
        np.testing.assert_allclose(actual[k], desired[k], rtol=1e-5, atol=1e-5 * scale + 1e-9, err_msg=k)


def assert_trees_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_fresh_adapter_equals_base_exactly(engine, rng):
    engine.create_adapter(0, LoraConfig(rank=4, seed=0, train_attn=False, train_mlp=False, train_unembed=False))
    engine.create_adapter(1, LoraConfig(rank=8, seed=0))
    assert any(np.any(v != 0) for k, v in engine.adapter_weights(1).items() if k.endswith("lora_a"))
    assert all(np.all(v == 0) for k, v in engine.adapter_weights(1).items() if k.endswith("lora_b"))
    batch = seqs(rng, 2, 12)
    base, fresh = engine.forward_backward([ce(0, batch, forward_only=True), ce(1, batch, forward_only=True)])
    for a, b in zip(base.outputs, fresh.outputs):
        np.testing.assert_array_equal(a["logprobs"], b["logprobs"])
    assert base.metrics["loss:sum"] == fresh.metrics["loss:sum"] > 0


def test_same_seed_same_init(engine):
    engine.create_adapter(0, LoraConfig(rank=4, seed=42))
    first = engine.adapter_weights(0)
    engine.create_adapter(0, LoraConfig(rank=4, seed=42))
    assert_trees_equal(first, engine.adapter_weights(0))


def test_result_shapes_and_loss_sum(engine, rng):
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    [res] = engine.forward_backward([ce(0, [rng.integers(1, 300, 9), rng.integers(1, 300, 5)], forward_only=True)])
    assert [o["logprobs"].shape for o in res.outputs] == [(8,), (4,)]
    assert all(
        o["logprobs"].dtype == np.float32 and o["elementwise_loss"].shape == o["logprobs"].shape for o in res.outputs
    )
    total = sum(-o["logprobs"].astype(np.float64).sum() for o in res.outputs)
    assert res.metrics["loss:sum"] == pytest.approx(total, rel=1e-6)
    assert all(k.count(":") == 1 for k in res.metrics)


def test_grads_of_one_adapter_ignore_other_adapters_examples(engine, rng):
    mine = seqs(rng, 2, 12)
    grads = []
    for other in (seqs(rng, 1, 10), seqs(rng, 2, 14)):
        engine.create_adapter(0, LoraConfig(rank=4, seed=1))
        engine.create_adapter(1, LoraConfig(rank=4, seed=2))
        engine.forward_backward([ce(1, other), ce(0, mine)])
        grads.append(engine.accumulated_grads(0))
    assert_grads_close(grads[1], grads[0])
    assert any(np.any(g != 0) for g in grads[0].values())


def test_steps_touch_only_their_slot_and_rank(engine, rng):
    engine.create_adapter(0, LoraConfig(rank=2, seed=1, train_mlp=False))
    engine.create_adapter(1, LoraConfig(rank=4, seed=2))
    untouched_before = snapshot_state(engine, 1)
    for _ in range(3):
        engine.forward_backward([ce(0, seqs(rng, 2, 12))])
        metrics = engine.optim_step(0, ADAM)
        assert metrics["grad_norm"] > 0
    for before, after in zip(untouched_before, snapshot_state(engine, 1)):
        assert_trees_equal(before, after)
    after = engine.adapter_weights(0)
    for k, v in after.items():
        if ".mlp." in k:
            assert np.all(v == 0), f"{k}: train_mlp=False must stay zero"
        elif k.endswith("lora_b"):
            assert np.any(v != 0), f"{k} should have trained"
    assert all(np.all(v == 0) for v in engine.accumulated_grads(0).values()), "optim_step clears the accumulator"
    # Beyond rank 2 everything stays exactly zero (check in the untrimmed state).
    full = {k: np.asarray(v[0]) for k, v in _flat(engine.adapters.lora).items()}
    for k, v in full.items():
        tail = v[..., 2:] if k.endswith("lora_a") else v[..., 2:, :]  # the rank axis (stacked layers: [L, ...])
        assert np.all(tail == 0), k
    assert engine.optim_step(0, ADAM)["step"] == 4


def _flat(tree):
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [getattr(k, "key", getattr(k, "name", k)) for k in path]
        out[".".join(str(k) for k in keys if k != "value")] = leaf
    return out


def test_unused_slot_unchanged(engine, rng):
    engine.free_adapter(3)
    before = {k: np.asarray(v[3]) for k, v in _flat(engine.adapters.lora).items()}
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    engine.forward_backward([ce(0, seqs(rng, 1, 12))])
    engine.optim_step(0, ADAM)
    after = {k: np.asarray(v[3]) for k, v in _flat(engine.adapters.lora).items()}
    assert all(np.all(before[k] == after[k]) and np.all(after[k] == 0) for k in before)


def test_padding_and_bucket_do_not_change_results(engine, rng):
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    short = rng.integers(1, 300, 8)
    [alone] = engine.forward_backward([ce(0, [short])])
    g_alone = engine.accumulated_grads(0)
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    # A long neighbour moves the batch to a larger sequence bucket and a larger row bucket.
    mixed, _ = engine.forward_backward([ce(0, [short], weights=1.0), ce(0, [rng.integers(1, 300, 20)], weights=0.0)])
    np.testing.assert_allclose(mixed.outputs[0]["logprobs"], alone.outputs[0]["logprobs"], rtol=1e-5, atol=1e-5)
    assert_grads_close(engine.accumulated_grads(0), g_alone)


def test_micro_batches_equal_full_batch(engine, rng):
    batch = seqs(rng, 4, 12)
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    [full] = engine.forward_backward([ce(0, batch)])
    g_full = engine.accumulated_grads(0)
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    saved, engine.micro_batch_tokens = engine.micro_batch_tokens, 16  # one row per micro-batch
    try:
        [micro] = engine.forward_backward([ce(0, batch)])
    finally:
        engine.micro_batch_tokens = saved
    assert micro.metrics["loss:sum"] == pytest.approx(full.metrics["loss:sum"], rel=1e-5)
    assert_grads_close(engine.accumulated_grads(0), g_full)


def test_forward_only_accumulates_nothing_and_grads_accumulate(engine, rng):
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    batch = seqs(rng, 1, 12)
    engine.forward_backward([ce(0, batch, forward_only=True)])
    assert all(np.all(g == 0) for g in engine.accumulated_grads(0).values())
    engine.forward_backward([ce(0, batch)])
    once = engine.accumulated_grads(0)
    engine.forward_backward([ce(0, batch)])
    assert_grads_close(engine.accumulated_grads(0), {k: 2 * g for k, g in once.items()})


def rl(slot, tokens, loss_fn, **inputs):
    tokens = np.asarray(tokens, np.int32)
    full = {"target_tokens": tokens[1:], **inputs}
    return ForwardBackwardInput(slot=slot, data=[Datum(tokens=tokens[:-1], inputs=full)], loss_fn=loss_fn)


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro"])
def test_rl_losses_through_the_engine(engine, rng, loss_fn):
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    tokens = rng.integers(1, 300, 11)
    [ref] = engine.forward_backward([ce(0, [tokens], forward_only=True)])
    lp = ref.outputs[0]["logprobs"]
    old = lp + rng.normal(0, 0.3, lp.shape).astype(np.float32)
    adv = rng.normal(0, 1, lp.shape).astype(np.float32)
    [res] = engine.forward_backward([rl(0, tokens, loss_fn, logprobs=old, advantages=adv)])
    ratio = np.exp(lp.astype(np.float64) - old)
    expected = {
        "importance_sampling": -ratio * adv,
        "ppo": -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv),
        "cispo": -np.clip(ratio, 0.0, 4.0) * lp * adv,
        "dro": -(lp * adv - 0.5 * 0.05 * (lp - old) ** 2),
    }[loss_fn]
    np.testing.assert_allclose(res.outputs[0]["logprobs"], lp, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(res.outputs[0]["elementwise_loss"], expected, rtol=1e-4, atol=1e-5)
    assert res.metrics["loss:sum"] == pytest.approx(expected.sum(), rel=1e-4, abs=1e-5)
    assert any(np.any(g != 0) for g in engine.accumulated_grads(0).values())


def test_gspo_and_stable_reinforce_through_the_engine(engine, rng):
    """The sequence-level and provenance-fed losses, end to end through validation, packing and the step."""
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    tokens = rng.integers(1, 300, 11)
    [ref] = engine.forward_backward([ce(0, [tokens], forward_only=True)])
    lp = ref.outputs[0]["logprobs"].astype(np.float64)
    old = (lp + rng.normal(0, 0.3, lp.shape)).astype(np.float32)
    sampled = np.array([0.0] * 3 + [1.0] * 7, np.float32)  # 3 prompt targets, then 7 sampled tokens
    adv = (sampled * 0.7).astype(np.float32)
    ratio_mask = sampled
    [g] = engine.forward_backward([rl(0, tokens, "gspo", logprobs=old, advantages=adv, sequence_ratio_mask=ratio_mask)])
    s = np.exp(np.sum(ratio_mask * (lp - old)) / ratio_mask.sum())
    lo, hi = 1 - 3e-4, 1 + 4e-4
    np.testing.assert_allclose(
        g.outputs[0]["elementwise_loss"], -np.minimum(s * adv, np.clip(s, lo, hi) * adv), rtol=1e-4, atol=1e-5
    )
    req = rl(0, tokens, "stable_reinforce", logprobs=old, advantages=adv)
    req.data[0].sampled_mask = sampled
    [sr] = engine.forward_backward([req])
    r = np.exp(lp - old)
    keep = (r >= 0.5) & (r <= 2.0)
    np.testing.assert_allclose(sr.outputs[0]["elementwise_loss"], -sampled * keep * r * lp * adv, rtol=1e-4, atol=1e-5)


def _sr(sampled_mask, adv):
    d = Datum(
        np.array([1, 2, 3]),
        {"target_tokens": np.array([2, 3, 4]), "logprobs": np.zeros(3), "advantages": np.asarray(adv, np.float32)},
        sampled_mask=sampled_mask,
    )
    return ForwardBackwardInput(slot=0, data=[d], loss_fn="stable_reinforce")


def test_topk_cross_entropy_targets(engine, rng):
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    tokens = rng.integers(1, 300, 9).astype(np.int32)
    targets = rng.integers(1, 300, (8, 3))
    w = rng.uniform(0, 1, (8, 3)).astype(np.float32)
    req = ForwardBackwardInput(
        slot=0,
        data=[Datum(tokens=tokens[:-1], inputs={"target_tokens": targets, "weights": w})],
        loss_fn="cross_entropy",
        forward_only=True,
    )
    [res] = engine.forward_backward([req])
    assert res.outputs[0]["logprobs"].shape == (8, 3)
    singles = engine.forward_backward(
        [
            ForwardBackwardInput(
                slot=0,
                data=[Datum(tokens=tokens[:-1], inputs={"target_tokens": targets[:, j]})],
                loss_fn="cross_entropy",
                forward_only=True,
            )
            for j in range(3)
        ]
    )
    stacked = np.stack([s.outputs[0]["logprobs"] for s in singles], axis=1)
    np.testing.assert_allclose(res.outputs[0]["logprobs"], stacked, rtol=1e-5, atol=1e-5)
    assert res.metrics["loss:sum"] == pytest.approx(float(-(stacked * w).sum()), rel=1e-5)


BAD = [
    (
        lambda: ForwardBackwardInput(
            slot=0, data=[Datum(np.array([1, 2, 300]), {"target_tokens": np.array([1, 2, 3])})], loss_fn="cross_entropy"
        ),
        "token id 300 outside",
    ),
    (
        lambda: ForwardBackwardInput(
            slot=0, data=[Datum(np.array([1, 2, 3]), {"target_tokens": np.array([1, 2])})], loss_fn="cross_entropy"
        ),
        "target_tokens has 2 entries but model_input has 3 tokens",
    ),
    (
        lambda: ForwardBackwardInput(
            slot=0, data=[Datum(np.array([1, 2]), {"target_tokens": np.array([1, -1])})], loss_fn="cross_entropy"
        ),
        "token id -1",
    ),
    (
        lambda: ForwardBackwardInput(
            slot=0, data=[Datum(np.array([1, 2]), {"target_tokens": np.array([1, 2])})], loss_fn="foo"
        ),
        "unknown loss_fn 'foo'; supported: cross_entropy, importance_sampling",
    ),
    (
        lambda: ForwardBackwardInput(
            slot=0,
            data=[Datum(np.array([1, 2]), {"target_tokens": np.array([1, 2]), "logprobs": np.zeros(2)})],
            loss_fn="importance_sampling",
        ),
        "importance_sampling needs loss_fn_inputs\\['advantages'\\]",
    ),
    (
        lambda: ForwardBackwardInput(
            slot=0,
            data=[Datum(np.array([1, 2]), {"target_tokens": np.array([1, 2]), "weights": np.array([1.0, np.nan])})],
            loss_fn="cross_entropy",
        ),
        "weights contains non-finite",
    ),
    (lambda: ForwardBackwardInput(slot=0, data=[], loss_fn="cross_entropy"), "at least one datum"),
    (
        lambda: ForwardBackwardInput(
            slot=3, data=[Datum(np.array([1]), {"target_tokens": np.array([1])})], loss_fn="cross_entropy"
        ),
        "slot 3 is not allocated",
    ),
    (
        lambda: ForwardBackwardInput(
            slot=9, data=[Datum(np.array([1]), {"target_tokens": np.array([1])})], loss_fn="cross_entropy"
        ),
        "slot 9 out of range",
    ),
    (
        lambda: ForwardBackwardInput(
            slot=0,
            data=[Datum(np.array([1]), {"target_tokens": np.array([1])})],
            loss_fn="ppo",
            loss_fn_config={"clip": 1.0},
        ),
        "does not take loss_fn_config",
    ),
    (lambda: _sr(None, [0, 1, 1]), "stable_reinforce needs provenance"),
    (
        lambda: _sr(np.array([0, 1, 1], np.float32), [1, 1, 1]),
        "advantages must be 0 outside the sampled tokens for stable_reinforce; position 0",
    ),
    (lambda: _sr(np.array([0, 1], np.float32), [0, 1, 1]), "loss_fn_input_spans has 2 entries but model_input has 3"),
]


@pytest.mark.parametrize("make_bad,message", BAD)
def test_bad_request_fails_alone(engine, rng, make_bad, message):
    engine.free_adapter(3)
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    good = seqs(rng, 1, 12)
    [ref] = engine.forward_backward([ce(0, good, forward_only=True)])
    before = snapshot_state(engine, 0)
    bad_result, good_result = engine.forward_backward([make_bad(), ce(0, good, forward_only=True)])
    assert isinstance(bad_result, InputError)
    assert re.search(message, str(bad_result)), str(bad_result)
    np.testing.assert_array_equal(good_result.outputs[0]["logprobs"], ref.outputs[0]["logprobs"])
    after = snapshot_state(engine, 0)
    assert_trees_equal(before[0], after[0])
    assert_trees_equal(before[1], after[1])


def test_create_adapter_rejects_large_rank(engine):
    with pytest.raises(InputError, match="rank 9"):
        engine.create_adapter(0, LoraConfig(rank=9))


def test_a_step_that_would_make_weights_non_finite_is_refused_and_changes_nothing(engine, rng):
    """lr=1e30 leaves finite but enormous weights; the next gradients are NaN. That step is refused (a user error
    that says so), weights and moments stay, the NaN gradients are dropped, and a load brings the run back."""
    engine.create_adapter(0, LoraConfig(rank=2, seed=3))
    engine.forward_backward([ce(0, seqs(rng, 1, 8))])
    engine.optim_step(0, AdamConfig(learning_rate=1e30))
    engine.forward_backward([ce(0, seqs(rng, 1, 8))])
    before = engine.export_slot(0)
    with pytest.raises(InputError, match="not finite"):
        engine.optim_step(0, AdamConfig(learning_rate=1e-4))
    after = engine.export_slot(0)
    assert_trees_equal(before.weights, after.weights)
    assert_trees_equal(before.mu, after.mu)
    assert after.step == before.step
    assert all(np.all(v == 0) for v in engine.accumulated_grads(0).values()), "NaN gradients are dropped"
