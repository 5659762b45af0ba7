"""Sampling: KV cache == full forward, sampler logprobs == trainer logprobs, seeds, stops, snapshots, validation,
continuous batching (more rows than slots, batch-independent results, no compiles for a steady workload)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tinkerflow.workers.engine.model.kv_cache import empty_cache
from tinkerflow.workers.engine.model.loader import load_model
from tinkerflow.workers.engine.model.lora import LoraRouting
from tinkerflow.workers.engine.types import (
    AdamConfig,
    Datum,
    ForwardBackwardInput,
    InputError,
    LoraConfig,
    SampleInput,
)

PROMPT = np.array([5, 17, 42, 99, 3, 250, 7], np.int32)


@pytest.fixture(autouse=True)
def _small_slot_set(engine):
    """One slot bucket of 8 rows (not 8, 64, 256): fewer and smaller programs to compile in this module, and
    requests with more rows than that go through continuous batching."""
    saved = engine.sample_slots
    engine.sample_slots = 8
    yield
    engine.sample_slots = saved


def trainer_logprobs(engine, slot, prompt, completion):
    full = np.concatenate([prompt, completion]).astype(np.int32)
    req = ForwardBackwardInput(
        slot=slot,
        data=[Datum(tokens=full[:-1], inputs={"target_tokens": full[1:]})],
        loss_fn="cross_entropy",
        forward_only=True,
    )
    [res] = engine.forward_backward([req])
    return res.outputs[0]["logprobs"]


def test_kv_cache_decode_equals_full_forward(qwen3_dir):
    loaded = load_model(str(qwen3_dir), max_adapters=1, max_rank=1, progress=False)
    routing = LoraRouting(adapter=jnp.zeros((2,), jnp.int32), scale=jnp.zeros((2,), jnp.float32))

    @jax.jit
    def full(tokens):
        model = nnx.merge(loaded.graphdef, loaded.lora, loaded.base)
        return model(tokens, jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape), routing)

    @jax.jit
    def step(tokens, positions, cache):
        model = nnx.merge(loaded.graphdef, loaded.lora, loaded.base)
        h, cache = model.hidden(tokens, positions, routing, cache)
        return model.logits(h, routing), cache

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 300, (2, 12)), jnp.int32)
    cache = empty_cache(loaded.config, 2, 16)
    logits, cache = step(tokens[:, :5], jnp.broadcast_to(jnp.arange(5), (2, 5)), cache)
    steps = [logits]
    for t in range(5, 12):
        logits, cache = step(tokens[:, t : t + 1], jnp.full((2, 1), t), cache)
        steps.append(logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full(tokens), atol=1e-4, rtol=1e-4)


@pytest.fixture
def trained_snapshot(engine, rng):
    """Slot 0 trained for a step (so LoRA B is non-zero), snapshotted as 'snap'."""
    engine.create_adapter(0, LoraConfig(rank=4, seed=3))
    toks = rng.integers(1, 300, 12).astype(np.int32)
    engine.forward_backward(
        [ForwardBackwardInput(slot=0, data=[Datum(toks[:-1], {"target_tokens": toks[1:]})], loss_fn="cross_entropy")]
    )
    engine.optim_step(0, AdamConfig(learning_rate=0.05))
    engine.snapshot(0, "snap")
    yield "snap"
    engine.drop_snapshot("snap")


def test_sampler_logprobs_equal_trainer_logprobs(engine, trained_snapshot):
    reqs = [
        SampleInput(
            prompt=PROMPT,
            num_samples=2,
            max_tokens=12,
            seed=1,
            snapshot=trained_snapshot,
            stop_token_ids=[],
            include_prompt_logprobs=True,
        ),
        SampleInput(prompt=PROMPT[:4], max_tokens=9, seed=2, stop_token_ids=[]),  # base model, other length
    ]
    snap_res, base_res = engine.sample(reqs)
    for seq in snap_res.sequences:
        assert len(seq.tokens) == 12 and seq.stop_reason == "length"
        ref = trainer_logprobs(engine, 0, PROMPT, np.array(seq.tokens))
        np.testing.assert_allclose(seq.logprobs, ref[len(PROMPT) - 1 :], atol=1e-4)
        assert snap_res.prompt_logprobs[0] is None
        np.testing.assert_allclose(snap_res.prompt_logprobs[1:], ref[: len(PROMPT) - 1], atol=1e-4)
    # The base model is a slot whose adapter is all zero.
    engine.create_adapter(1, LoraConfig(rank=1, seed=0, train_attn=False, train_mlp=False, train_unembed=False))
    [seq] = base_res.sequences
    ref = trainer_logprobs(engine, 1, PROMPT[:4], np.array(seq.tokens))
    np.testing.assert_allclose(seq.logprobs, ref[3:], atol=1e-4)


def test_greedy_is_deterministic_and_top_k_1_is_greedy(engine):
    greedy: dict[str, Any] = dict(prompt=PROMPT, max_tokens=10, temperature=0.0, stop_token_ids=[])
    a, b, c = engine.sample(
        [
            SampleInput(**greedy),
            SampleInput(**greedy, num_samples=2),
            SampleInput(**{**greedy, "temperature": 1.0}, top_k=1, seed=5),
        ]
    )
    tokens = a.sequences[0].tokens
    assert [s.tokens for s in b.sequences] == [tokens, tokens] and c.sequences[0].tokens == tokens
    assert len(set(tokens)) > 1, "fixture too degenerate: greedy decoding repeats one token"


def test_seeds(engine):
    def run(seed, n=2):
        [res] = engine.sample([SampleInput(prompt=PROMPT, num_samples=n, max_tokens=10, seed=seed, stop_token_ids=[])])
        return [s.tokens for s in res.sequences]

    first = run(7)
    assert run(7) == first
    assert first[0] != first[1], "samples of one request must differ"
    assert run(8) != first
    assert run(None) != run(None)
    # Batch composition does not change a seeded request's samples.
    res = engine.sample(
        [
            SampleInput(prompt=PROMPT[:3], max_tokens=4, seed=1),
            SampleInput(prompt=PROMPT, num_samples=2, max_tokens=10, seed=7, stop_token_ids=[]),
        ]
    )
    assert [s.tokens for s in res[1].sequences] == first


def _greedy(engine, **kw):
    [res] = engine.sample([SampleInput(prompt=PROMPT, max_tokens=12, temperature=0.0, **kw)])
    return res.sequences[0]


def test_stop_rules(engine):
    never = _greedy(engine, stop_token_ids=[])
    assert len(never.tokens) == 12 and never.stop_reason == "length"
    target = never.tokens[4]
    first = never.tokens.index(target)

    by_id = _greedy(engine, stop_token_ids=[target])
    assert by_id.tokens == never.tokens[: first + 1] and by_id.stop_reason == "stop"

    saved = engine.info
    engine.info = dataclasses.replace(saved, eos_token_ids=(target,))
    try:
        by_eos = _greedy(engine)  # stop_token_ids=None: stop at EOS
    finally:
        engine.info = saved
    assert by_eos.tokens == by_id.tokens and by_eos.stop_reason == "stop"

    text = engine.tokenizer.decode(never.tokens)
    cut = next(k for k in range(1, 13) if engine.tokenizer.decode(never.tokens[:k]).strip())
    piece = engine.tokenizer.decode(never.tokens[:cut])[-1:]
    assert piece and piece in text
    by_string = _greedy(engine, stop_token_ids=[], stop_strings=[piece])
    expected = next(k for k in range(1, 13) if piece in engine.tokenizer.decode(never.tokens[:k]))
    assert by_string.tokens == never.tokens[:expected] and by_string.stop_reason == "stop"


def test_max_tokens_is_clamped_to_the_context(engine):
    long_prompt = np.resize(PROMPT, engine.info.max_position_embeddings - 3)
    [res] = engine.sample([SampleInput(prompt=long_prompt, max_tokens=50, stop_token_ids=[], seed=0)])
    assert len(res.sequences[0].tokens) == 3 and res.sequences[0].stop_reason == "length"


def test_snapshot_is_immutable(engine, trained_snapshot):
    req = SampleInput(prompt=PROMPT, max_tokens=8, temperature=0.0, stop_token_ids=[], snapshot=trained_snapshot)
    [before] = engine.sample([req])
    engine.create_adapter(0, LoraConfig(rank=4, seed=99))  # re-initialise the source slot
    [after] = engine.sample([req])
    assert after.sequences[0].tokens == before.sequences[0].tokens
    np.testing.assert_array_equal(after.sequences[0].logprobs, before.sequences[0].logprobs)


@pytest.mark.parametrize(
    "bad,message",
    [
        (dict(prompt=np.array([1, 300])), "token id 300"),
        (dict(prompt=np.array([], np.int32)), "prompt is empty"),
        (dict(prompt=np.resize(PROMPT, 256)), "max_position_embeddings=256"),
        (dict(prompt=PROMPT, snapshot="nope"), "unknown sampler snapshot 'nope'"),
        (dict(prompt=PROMPT, top_p=0.0), "top_p"),
        (dict(prompt=PROMPT, temperature=-1.0), "temperature"),
    ],
)
def test_bad_sample_request_fails_alone(engine, bad, message):
    good = SampleInput(prompt=PROMPT, max_tokens=6, temperature=0.0, stop_token_ids=[])
    [ref] = engine.sample([good])
    bad_res, good_res = engine.sample([SampleInput(**bad), good])
    assert isinstance(bad_res, InputError) and message in str(bad_res), str(bad_res)
    assert good_res.sequences[0].tokens == ref.sequences[0].tokens


def test_top_p_and_top_k_restrict_the_support(engine):
    [greedy] = engine.sample([SampleInput(prompt=PROMPT, max_tokens=6, temperature=0.0, stop_token_ids=[])])
    [tiny_p] = engine.sample([SampleInput(prompt=PROMPT, max_tokens=6, top_p=1e-6, seed=3, stop_token_ids=[])])
    assert tiny_p.sequences[0].tokens == greedy.sequences[0].tokens
    [top3] = engine.sample([SampleInput(prompt=PROMPT, max_tokens=1, top_k=3, num_samples=16, seed=4)])
    assert len({s.tokens[0] for s in top3.sequences}) <= 3


def _tokens(res):
    return [s.tokens for s in res.sequences]


def _mixed_requests():
    rng = np.random.default_rng(11)
    return [
        SampleInput(
            prompt=rng.integers(1, 300, 3 + i % 9).astype(np.int32),
            num_samples=1 + i % 3,
            max_tokens=4 + (7 * i) % 13,
            seed=100 + i,
            temperature=[1.0, 0.7, 0.0][i % 3],
            top_k=[-1, 5, -1][i % 3],
            stop_token_ids=[] if i % 2 else None,
        )
        for i in range(7)
    ]


def test_continuous_batching_admits_more_rows_than_slots(engine):
    reqs = _mixed_requests()
    alone = [engine.sample([r])[0] for r in reqs]
    assert engine.sample_slots == 8  # 14 rows through 8 slots: finished rows' slots are refilled
    together = engine.sample(reqs)
    assert sum(r.num_samples for r in reqs) > 8
    for a, b, r in zip(alone, together, reqs):
        assert len(b.sequences) == r.num_samples
        assert _tokens(a) == _tokens(b)
        for sa, sb in zip(a.sequences, b.sequences):
            assert sa.stop_reason == sb.stop_reason and 1 <= len(sb.tokens) <= r.max_tokens
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-5)


def test_seeded_results_do_not_depend_on_batch_composition(engine):
    probe = SampleInput(
        prompt=PROMPT, num_samples=3, max_tokens=10, seed=42, top_p=0.9, stop_token_ids=[], include_prompt_logprobs=True
    )
    [ref] = engine.sample([probe])
    for others in (_mixed_requests()[:2], _mixed_requests()):
        got = engine.sample(others[:1] + [probe] + others[1:])[1]
        assert _tokens(got) == _tokens(ref)
        np.testing.assert_allclose(got.prompt_logprobs[1:], ref.prompt_logprobs[1:], atol=1e-5)
        for a, b in zip(ref.sequences, got.sequences):
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def _sampler_compiles(engine) -> int:
    return engine._sampler.compile_count()


def test_a_steady_workload_compiles_nothing_new(engine):
    def workload(n):
        return engine.sample(
            [
                SampleInput(prompt=PROMPT[: 3 + i % 5], num_samples=2, max_tokens=6, seed=i, stop_token_ids=[])
                for i in range(n)
            ]
        )

    engine.sample_slots = 64  # slot buckets 8 and 64
    workload(1)
    before = _sampler_compiles(engine)
    # The same shape family at other batch sizes (other slot buckets), then the first workload again.
    workload(20)
    workload(3)
    first = workload(1)
    assert _sampler_compiles(engine) == before
    assert _tokens(workload(1)[0]) == _tokens(first[0])
    assert _sampler_compiles(engine) == before


def test_rows_of_different_snapshots_share_a_batch(engine, trained_snapshot, rng):
    # A second snapshot with other weights: the batch then stacks two adapters (plus base-model rows).
    engine.create_adapter(1, LoraConfig(rank=2, seed=8))
    toks = rng.integers(1, 300, 10).astype(np.int32)
    engine.forward_backward(
        [ForwardBackwardInput(slot=1, data=[Datum(toks[:-1], {"target_tokens": toks[1:]})], loss_fn="cross_entropy")]
    )
    engine.optim_step(1, AdamConfig(learning_rate=0.05))
    engine.snapshot(1, "snap2")
    try:
        reqs = [
            SampleInput(prompt=PROMPT, max_tokens=8, num_samples=2, seed=5, snapshot=s, stop_token_ids=[])
            for s in (trained_snapshot, "snap2", None)
        ]
        alone = [engine.sample([r])[0] for r in reqs]
        together = engine.sample(reqs)
        assert len({tuple(a.sequences[0].tokens) for a in alone}) > 1, "snapshots should sample differently"
        for a, b in zip(alone, together):
            assert _tokens(a) == _tokens(b)
            for sa, sb in zip(a.sequences, b.sequences):
                np.testing.assert_allclose(sa.logprobs, sb.logprobs, atol=1e-5)
        seq = together[1].sequences[0]
        ref = trainer_logprobs(engine, 1, PROMPT, np.array(seq.tokens))
        np.testing.assert_allclose(seq.logprobs, ref[len(PROMPT) - 1 :], atol=1e-4)
    finally:
        engine.drop_snapshot("snap2")


def test_topk_prompt_logprobs_are_the_trainers_top_tokens(engine, trained_snapshot):
    """topk_prompt_logprobs=k: at every prompt position the k most likely next tokens, as the trainer scores them."""
    k = 5
    [res] = engine.sample(
        [SampleInput(prompt=PROMPT, max_tokens=1, seed=0, snapshot=trained_snapshot, topk_prompt_logprobs=k)]
    )
    assert res.prompt_logprobs is None  # only what was asked for
    ids, lps = res.topk_prompt_logprobs
    assert ids.shape == lps.shape == (len(PROMPT), k)
    assert ids[0].tolist() == [0] * k and lps[0].tolist() == [-99999.0] * k  # nothing predicts token 0
    # Score every vocabulary token at every position with the trainer ([N, V] targets): the sampler's rows must be
    # the top k of that, in descending order.
    vocab = engine.info.vocab_size
    every = np.broadcast_to(np.arange(vocab, dtype=np.int64), (len(PROMPT) - 1, vocab))
    req = ForwardBackwardInput(
        slot=0,
        data=[Datum(tokens=PROMPT[:-1], inputs={"target_tokens": every})],
        loss_fn="cross_entropy",
        forward_only=True,
    )
    [full] = engine.forward_backward([req])
    full_lp = full.outputs[0]["logprobs"]  # [P-1, V]
    expected_ids = np.argsort(-full_lp, axis=1, kind="stable")[:, :k]
    np.testing.assert_allclose(lps[1:], np.take_along_axis(full_lp, ids[1:].astype(np.int64), axis=1), atol=1e-4)
    np.testing.assert_allclose(lps[1:], np.take_along_axis(full_lp, expected_ids, axis=1), atol=1e-4)
    assert np.all(np.diff(lps[1:], axis=1) <= 0)


def test_topk_prompt_logprobs_beyond_the_limit_is_refused(engine):
    [res] = engine.sample([SampleInput(prompt=PROMPT, max_tokens=1, topk_prompt_logprobs=10_000)])
    assert isinstance(res, InputError) and "topk_prompt_logprobs must be in [0, 20]" in str(res)


def test_a_call_over_more_snapshots_than_a_stack_holds_runs_in_batches_with_each_rows_own_weights(engine, rng):
    """17 snapshots of different weights in one call (a stack holds 16): decoded in two batches, every request's
    tokens and logprobs those it gets alone (atol 1e-5, the batch-composition tolerance above)."""
    from tinkerflow.workers.engine.sampling.buckets import STACK_SIZES

    n = STACK_SIZES[-1] + 1
    engine.create_adapter(1, LoraConfig(rank=2, seed=3))
    shapes = engine.export_slot(1)
    keys = [f"many:{i}" for i in range(n)]
    try:
        for key in keys:
            weights = {k: (0.05 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in shapes.weights.items()}
            engine.load_snapshot(key, shapes.config, weights)
        reqs = [SampleInput(prompt=PROMPT, max_tokens=6, seed=11, snapshot=k, stop_token_ids=[]) for k in keys]
        together = engine.sample(reqs)
        assert len({tuple(r.sequences[0].tokens) for r in together}) > 1, "snapshots should sample differently"
        for req, got in zip(reqs, together):
            [alone] = engine.sample([req])
            assert _tokens(alone) == _tokens(got)
            np.testing.assert_allclose(alone.sequences[0].logprobs, got.sequences[0].logprobs, atol=1e-5)
    finally:
        for key in keys:
            engine.drop_snapshot(key)
        engine.free_adapter(1)


def test_a_stop_list_past_the_one_width_is_refused_naming_the_limit(engine):
    from tinkerflow.workers.engine.sampling.buckets import STOP_IDS

    stops = list(range(1, STOP_IDS + 1))
    [refused] = engine.sample([SampleInput(prompt=PROMPT, max_tokens=2, stop_token_ids=stops)])
    assert isinstance(refused, InputError) and f"at most {STOP_IDS}" in str(refused)
    [ok] = engine.sample([SampleInput(prompt=PROMPT, max_tokens=2, stop_token_ids=stops[: STOP_IDS // 2])])
    assert not isinstance(ok, Exception)
