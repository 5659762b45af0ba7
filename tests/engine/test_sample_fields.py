"""Every SampleRequest field the engine answers, checked against the trainer's forward log-probs (atol 1e-4, the
sampler/trainer parity tolerance of test_sampler.py: the two paths reduce in different orders in float32), and the
prefix KV cache: exact (1e-5 against the same sampling without it: the cached keys and values are the ones a full
prefill computes, up to float32 summation order), counted in prompt_cache_hit_tokens, bounded."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from sample_rows import sample_row

from tinkerflow.workers.engine.sampling import admission
from tinkerflow.workers.engine.sampling.prefix_cache import BLOCK, PrefixIndex
from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, InputError, SampleInput

PROMPT = np.array([5, 17, 42, 99, 3, 250, 7], np.int32)
LONG = np.resize(np.array([5, 17, 42, 99, 3, 250, 7, 11, 60], np.int32), 45)  # two whole blocks and a part
TRAINER_ATOL = 1e-4
CACHE_ATOL = 1e-5


@pytest.fixture(autouse=True)
def _small_slot_set(engine):
    saved = engine.sample_slots
    engine.sample_slots = 8
    yield
    engine.sample_slots = saved


def full_logprobs(engine, tokens: np.ndarray) -> np.ndarray:
    """The trainer's log-probs of every vocabulary token after each of tokens[:-1]... tokens[:n]: [len - 1, V]
    (base model: a slot whose adapter is zero)."""
    from tinkerflow.workers.engine.types import LoraConfig

    engine.create_adapter(1, LoraConfig(rank=1, seed=0, train_attn=False, train_mlp=False, train_unembed=False))
    vocab = engine.info.vocab_size
    every = np.broadcast_to(np.arange(vocab, dtype=np.int64), (len(tokens) - 1, vocab))
    req = ForwardBackwardInput(
        slot=1,
        data=[Datum(tokens=tokens[:-1], inputs={"target_tokens": every})],
        loss_fn="cross_entropy",
        forward_only=True,
    )
    [res] = engine.forward_backward([req])
    return res.outputs[0]["logprobs"]


def test_topk_sample_logprobs_are_the_trainers_top_tokens(engine):
    k = 4
    [res] = engine.sample([SampleInput(prompt=PROMPT, max_tokens=6, seed=3, stop_token_ids=[], topk_sample_logprobs=k)])
    [seq] = res.sequences
    ids, lps = seq.topk_logprobs
    assert ids.shape == lps.shape == (6, k)
    ref = full_logprobs(engine, np.concatenate([PROMPT, seq.tokens]))[len(PROMPT) - 1 :]  # [6, V]
    np.testing.assert_allclose(lps, np.take_along_axis(ref, ids.astype(np.int64), axis=1), atol=TRAINER_ATOL)
    np.testing.assert_allclose(lps, -np.sort(-ref, axis=1)[:, :k], atol=TRAINER_ATOL)
    [plain] = engine.sample([SampleInput(prompt=PROMPT, max_tokens=6, seed=3, stop_token_ids=[])])
    assert plain.sequences[0].topk_logprobs is None and plain.sequences[0].tokens == seq.tokens


def test_target_prompt_logprobs_score_the_named_ids(engine):
    targets = np.full((len(PROMPT) - 1, 3), -1, np.int64)
    targets[2] = [7, 8, 9]
    targets[5, 1] = 100
    [res] = engine.sample([SampleInput(prompt=PROMPT, max_tokens=1, seed=0, target_prompt_logprobs=targets)])
    got = res.target_prompt_logprobs
    assert got.dtype == np.float32 and got.shape == targets.shape
    ref = full_logprobs(engine, PROMPT)  # row i scores position i + 1
    want = np.where(targets >= 0, np.take_along_axis(ref, np.maximum(targets, 0), axis=1), 0.0)
    np.testing.assert_allclose(got, want, atol=TRAINER_ATOL)
    assert res.prompt_logprobs is None


def test_prompt_alt_tokens_are_draws_with_the_trainers_logprobs(engine):
    k = 3
    [res] = engine.sample([SampleInput(prompt=PROMPT, max_tokens=1, seed=4, prompt_alt_tokens_k=k)])
    ids, lps = res.prompt_alt_tokens
    assert ids.dtype == np.int64 and ids.shape == lps.shape == (len(PROMPT) - 1, k)
    ref = full_logprobs(engine, PROMPT)
    np.testing.assert_allclose(lps, np.take_along_axis(ref, ids, axis=1), atol=TRAINER_ATOL)
    [again] = engine.sample([SampleInput(prompt=PROMPT, max_tokens=1, seed=4, prompt_alt_tokens_k=k)])
    assert np.array_equal(again.prompt_alt_tokens[0], ids)  # a seed reproduces its draws
    [other] = engine.sample([SampleInput(prompt=PROMPT, max_tokens=1, seed=5, prompt_alt_tokens_k=k)])
    assert not np.array_equal(other.prompt_alt_tokens[0], ids)
    [greedy] = engine.sample([SampleInput(prompt=PROMPT, max_tokens=1, temperature=0.0, prompt_alt_tokens_k=2)])
    assert np.array_equal(greedy.prompt_alt_tokens[0], np.repeat(ref.argmax(axis=1)[:, None], 2, axis=1))


def test_prompt_logprobs_last_n_leaves_earlier_positions_unscored(engine):
    n = 3
    [res] = engine.sample(
        [
            SampleInput(
                prompt=LONG,
                max_tokens=1,
                seed=0,
                include_prompt_logprobs=True,
                topk_prompt_logprobs=2,
                prompt_logprobs_last_n=n,
            )
        ]
    )
    assert res.prompt_logprobs[: len(LONG) - n] == [None] * (len(LONG) - n)
    ref = full_logprobs(engine, LONG)
    want = np.take_along_axis(ref, LONG[1:, None].astype(np.int64), axis=1)[:, 0]
    np.testing.assert_allclose(res.prompt_logprobs[-n:], want[-n:], atol=TRAINER_ATOL)
    ids, lps = res.topk_prompt_logprobs
    assert (lps[: len(LONG) - n] == -99999.0).all() and (ids[: len(LONG) - n] == 0).all()
    np.testing.assert_allclose(lps[-n:], -np.sort(-ref, axis=1)[-n:, :2], atol=TRAINER_ATOL)


def test_a_stop_list_still_stops_at_eos(engine):
    [never] = engine.sample([SampleInput(prompt=PROMPT, max_tokens=12, temperature=0.0, stop_token_ids=[])])
    tokens = never.sequences[0].tokens
    eos = tokens[5]
    saved = engine.info
    engine.info = dataclasses.replace(saved, eos_token_ids=(eos,))
    try:
        by_string, by_id, none = engine.sample(
            [
                SampleInput(prompt=PROMPT, max_tokens=12, temperature=0.0, stop_strings=["never in this text"]),
                SampleInput(prompt=PROMPT, max_tokens=12, temperature=0.0, stop_token_ids=[2047 % saved.vocab_size]),
                SampleInput(prompt=PROMPT, max_tokens=12, temperature=0.0, stop_token_ids=[]),
            ]
        )
    finally:
        engine.info = saved
    cut = tokens.index(eos) + 1
    for res in (by_string, by_id):
        assert res.sequences[0].tokens == tokens[:cut] and res.sequences[0].stop_reason == "stop"
    assert none.sequences[0].tokens == tokens  # an empty list: not even EOS


def test_the_prefix_cache_is_exact_and_counted(engine):
    """A group of samples and a second turn reuse the prompt's blocks; every logprob equals sampling without the
    cache; another session's identical prompt finds nothing."""
    group: dict[str, Any] = dict(
        prompt=LONG, num_samples=5, max_tokens=8, seed=11, stop_token_ids=[], include_prompt_logprobs=True
    )
    turn2 = np.concatenate([LONG, [9, 9, 8, 7, 6, 5, 4, 3, 2, 1, 3, 2, 5, 6, 7, 8, 9, 10]]).astype(np.int32)
    sampler = engine.sampler
    index, sampler.prefix = sampler.prefix, None
    try:
        plain = engine.sample([SampleInput(**group), SampleInput(prompt=turn2, max_tokens=4, seed=2)])
    finally:
        sampler.prefix = index
    assert index is not None
    first = engine.sample([SampleInput(**group, cache_namespace="s1")])[0]
    second = engine.sample([SampleInput(prompt=turn2, max_tokens=4, seed=2, cache_namespace="s1")])[0]
    other = engine.sample([SampleInput(prompt=turn2, max_tokens=4, seed=2, cache_namespace="s2")])[0]
    assert first.prompt_cache_hit_tokens == 0  # the first sample prefilled it; the other four read it
    assert second.prompt_cache_hit_tokens == (len(LONG) // BLOCK) * BLOCK
    assert other.prompt_cache_hit_tokens == 0
    for got, want in zip(first.sequences, plain[0].sequences):
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=CACHE_ATOL)
    cached_lp, plain_lp = (np.array(r.prompt_logprobs[1:], float) for r in (first, plain[0]))
    np.testing.assert_allclose(cached_lp, plain_lp, atol=CACHE_ATOL)
    for res in (second, other):
        assert res.sequences[0].tokens == plain[1].sequences[0].tokens
        np.testing.assert_allclose(res.sequences[0].logprobs, plain[1].sequences[0].logprobs, atol=CACHE_ATOL)
    assert len(index) <= index.blocks


def test_an_admission_is_chunks_of_one_length_from_where_each_row_starts_in_the_cache():
    """Whatever the prompt lengths and cache hits, an admission is chunks of one shape: a row that starts in the
    cache copies its cached blocks in its first chunk and computes from there; each chunk writes the pool blocks of
    the whole blocks it computes; a row whose prompt ended is a padding row of the later chunks."""
    index = PrefixIndex(blocks=32)
    cached = np.arange(100, dtype=np.int32)
    index.plan_writes(("ns",), cached[: 2 * BLOCK + 1], [], set())  # blocks 0 and 1 of it are in the cache
    rows = [sample_row(cached), sample_row(np.arange(500, 520, dtype=np.int32))]
    adm = admission.plan(rows, [0, 1], [5, 6], index)
    assert adm.starts == [2 * BLOCK, 0] and adm.read[0] == [0, 1] and index.hits == 2 * BLOCK
    c, r, cache, slots, pool = 64, 2, 256, 8, 32
    chunks = list(adm.chunks(rows, r, c, cache, slots, pool))
    assert len(chunks) == 2  # row 0: 68 uncached tokens in two chunks of 64; row 1: 20 tokens in one
    first, second = chunks
    assert first.chunk.shape == second.chunk.shape == (r, c) and first.read.shape == (r, cache // BLOCK)
    assert first.start.tolist() == [2 * BLOCK, 0] and first.cached.tolist() == [2 * BLOCK, 0]
    assert first.read[0, :2].tolist() == [0, 1] and first.index.tolist() == [5, 6]
    assert first.final.tolist() == [False, True]
    np.testing.assert_array_equal(first.chunk[0], cached[32:96])
    np.testing.assert_array_equal(first.nexts[0], cached[33:97])
    assert first.nexts[1, 19] == -1  # nothing follows a prompt's last token
    assert (first.write[0] < pool).tolist() == [True] * 4 and (first.write[1] < pool).sum() == 1  # whole blocks
    assert second.start.tolist()[0] == 96 and second.final.tolist() == [True, False]
    assert second.index.tolist() == [5, slots] and second.cached.tolist() == [0, 0]  # row 1 is padding now
    assert (second.write[0] < pool).sum() == 0  # 96..99 is no whole block


def test_prefix_index_evicts_leaves_least_recently_used_first():
    index = PrefixIndex(blocks=3)
    a = np.arange(3 * BLOCK + 1, dtype=np.int32)
    assert index.plan_writes("ns", a, [], set()) == [0, 1, 2]
    assert index.lookup("ns", a, len(a) - 1) == [0, 1, 2]
    b = np.concatenate([a[:BLOCK], np.full(2 * BLOCK, 9, np.int32)])
    writes = index.plan_writes("ns", b, index.lookup("ns", b, len(b) - 1), set())
    assert writes == [2, 1]  # a's chain went from its leaf up; the block b shares with it stayed
    assert index.lookup("ns", a, len(a) - 1) == [0]
    assert index.lookup("ns", b, len(b) - 1) == [0, 2]  # its last token stays out: it is sampled from
    assert index.lookup("other", a, len(a) - 1) == []
    assert len(index) == 3
    assert index.plan_writes("ns", np.full(2 * BLOCK, 5, np.int32), [], {0, 1, 2}) == []  # all pinned: nothing


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("topk_sample_logprobs", 21, "topk_sample_logprobs must be in [0, 20]"),
        ("prompt_alt_tokens_k", 99, "prompt_alt_tokens_k must be in [0, 20]"),
        ("prompt_logprobs_last_n", 2, "prompt_logprobs_last_n applies to prompt logprobs"),
        ("target_prompt_logprobs", np.full((3, 1), 1), "target_prompt_logprobs must have shape [len(prompt) - 1, K]"),
        ("target_prompt_logprobs", np.full((6, 1), -1), "names no token id"),
        ("target_prompt_logprobs", np.full((6, 1), 10**6), "outside [0,"),
        ("target_prompt_logprobs", np.full((6, 65), 1), "65 columns; 1 to 64"),
    ],
)
def test_bad_fields_fail_alone_naming_the_field(engine, field, value, message):
    bad, good = engine.sample(
        [SampleInput(prompt=PROMPT, max_tokens=1, **{field: value}), SampleInput(prompt=PROMPT, max_tokens=1)]
    )
    assert isinstance(bad, InputError) and message in str(bad)
    assert not isinstance(good, InputError)
