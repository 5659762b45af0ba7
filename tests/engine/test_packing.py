"""Packing: the datums of a call share rows as segments, and every datum's numbers are what they are alone.

Per-datum losses, logprobs and gradients are equal packed and unpacked at 1e-5 (float32 sums in another order), for a
batch that mixes adapters, losses (cross_entropy with weights, ppo, gspo with its per-datum sequence ratio),
forward-only requests and ragged lengths; and the planner packs what it should."""

from __future__ import annotations

import numpy as np
from test_training import assert_grads_close

from tinkerflow.workers.engine.training.steps import PACK_TOKENS, Row, plan_micro_batches
from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, LoraConfig

TOL = 1e-5  # float32 sums in another order (attention blocks, the vocabulary's chunks, gradient accumulation)


def _datum(rng, n: int, loss: str) -> Datum:
    s = rng.integers(1, 300, n + 1).astype(np.int32)
    inputs: dict[str, np.ndarray] = {"target_tokens": s[1:]}
    if loss == "cross_entropy":
        inputs["weights"] = rng.uniform(0, 1, n).astype(np.float32)
    else:
        inputs["logprobs"] = rng.uniform(-4, -1, n).astype(np.float32)
        inputs["advantages"] = rng.normal(size=n).astype(np.float32)
        if loss == "gspo":
            inputs["sequence_ratio_mask"] = (rng.uniform(size=n) > 0.3).astype(np.float32)
    return Datum(tokens=s[:-1], inputs=inputs)


def _requests(rng) -> list[ForwardBackwardInput]:
    return [
        ForwardBackwardInput(
            slot=0, data=[_datum(rng, n, "cross_entropy") for n in (5, 31, 12, 7)], loss_fn="cross_entropy"
        ),
        ForwardBackwardInput(slot=0, data=[_datum(rng, n, "ppo") for n in (9, 3)], loss_fn="ppo"),
        ForwardBackwardInput(slot=1, data=[_datum(rng, n, "gspo") for n in (17, 11, 6)], loss_fn="gspo"),
        ForwardBackwardInput(
            slot=1, data=[_datum(rng, 14, "cross_entropy")], loss_fn="cross_entropy", forward_only=True
        ),
    ]


def _run(engine, requests, pack_tokens: int):
    engine.steps.pack_tokens = pack_tokens
    try:
        for slot, rank in ((0, 4), (1, 8)):  # the same seeds: the same starting weights, zero gradients
            engine.create_adapter(slot, LoraConfig(rank=rank, seed=slot + 1))
        results = engine.forward_backward(requests)
        return results, {slot: engine.accumulated_grads(slot) for slot in (0, 1)}
    finally:
        engine.steps.pack_tokens = PACK_TOKENS


def test_packed_and_unpacked_give_every_datum_the_same_numbers(engine):
    requests = _requests(np.random.default_rng(5))
    unpacked, grads_unpacked = _run(engine, requests, 0)
    packed, grads_packed = _run(engine, requests, 4096)
    for a, b in zip(packed, unpacked):
        np.testing.assert_allclose(a.metrics["loss:sum"], b.metrics["loss:sum"], rtol=TOL)
        for oa, ob in zip(a.outputs, b.outputs):
            np.testing.assert_allclose(oa["logprobs"], ob["logprobs"], rtol=TOL, atol=TOL)
            np.testing.assert_allclose(oa["elementwise_loss"], ob["elementwise_loss"], rtol=TOL, atol=TOL)
    for slot in (0, 1):
        assert_grads_close(grads_packed[slot], grads_unpacked[slot])


def _rows(lengths: list[int], slot: int = 0) -> list[Row]:
    z = np.zeros
    return [
        Row(
            tokens=z(n, np.int32),
            targets=z((n, 1), np.int32),
            weights=z((n, 1), np.float32),
            sampler_logprobs=z(n, np.float32),
            advantages=z(n, np.float32),
            seq_mask=z(n, np.float32),
            loss_id=0,
            clip_low=0.0,
            clip_high=0.0,
            beta=0.0,
            slot=slot,
            scale=1.0,
            train=True,
        )
        for n in lengths
    ]


def test_64_datums_of_50_tokens_pack_into_one_row():
    [plan] = plan_micro_batches(_rows([50] * 64), token_budget=16384)
    assert len(plan.packed) == 1 and plan.rows == 1 and plan.seq == 4096  # 3,200 tokens in one row
    assert sorted(plan.packed[0]) == list(range(64))
    unpacked = plan_micro_batches(_rows([50] * 64), token_budget=16384, pack_tokens=0)
    assert sum(p.rows for p in unpacked) == 64  # the layout packing replaces: a row per datum


def test_rows_hold_one_adapter_each_and_never_exceed_their_length():
    rows = _rows([300, 200, 100, 40, 40], slot=0) + _rows([30, 20], slot=1)
    plans = plan_micro_batches(rows, token_budget=16384, pack_tokens=512)
    for plan in plans:
        for members in plan.packed:
            assert len({rows[i].slot for i in members}) == 1
            assert sum(len(rows[i].tokens) for i in members) <= plan.seq
    assert sorted(i for p in plans for m in p.packed for i in m) == list(range(len(rows)))


def test_a_datum_longer_than_the_pack_length_gets_a_row_of_its_own_bucket():
    plans = plan_micro_batches(_rows([5000, 10, 10]), token_budget=65536, pack_tokens=4096)
    assert [p.seq for p in plans] == [6144]  # 5,000 -> bucket 6,144; the short ones fill its tail
    assert sorted(i for m in plans[0].packed for i in m) == [0, 1, 2]
