"""One tenant's non-finite adapter never reaches another row's numbers: sampled beside others (decode,
prefill, prompt logprobs), left behind in a reused slot's KV cache, or trained beside another slot.

"Bit-identical" is meant literally here: every other row's tokens and logprobs compare with ==, no tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from tinkerflow.workers.engine.types import (
    AdamConfig,
    Datum,
    ForwardBackwardInput,
    LoraConfig,
    SampleInput,
)

PROMPT = np.array([5, 17, 42, 99, 3, 250, 7], np.int32)


@pytest.fixture(autouse=True)
def _small_slot_set(engine):
    saved = engine.sample_slots
    engine.sample_slots = 8
    yield
    engine.sample_slots = saved


@pytest.fixture
def snapshots(engine):
    """'mine': a trained snapshot (another tenant's); 'good' and 'poison': the same weights, except every weight of
    'poison' is NaN, inf or -inf (what a learning rate of 1e30 makes)."""
    rng = np.random.default_rng(7)
    engine.create_adapter(0, LoraConfig(rank=4, seed=3))
    toks = rng.integers(1, 300, 12).astype(np.int32)
    engine.forward_backward(
        [ForwardBackwardInput(slot=0, data=[Datum(toks[:-1], {"target_tokens": toks[1:]})], loss_fn="cross_entropy")]
    )
    engine.optim_step(0, AdamConfig(learning_rate=0.05))
    engine.snapshot(0, "mine")
    engine.create_adapter(1, LoraConfig(rank=2, seed=8))
    good = engine.adapter_weights(1)
    good = {k: v + 0.01 for k, v in good.items()}  # B non-zero too, so 'good' is not the base model
    engine.set_adapter_weights(1, good)
    engine.snapshot(1, "good")
    # Through a slot, as training makes them (load_snapshot refuses non-finite files).
    bad = {k: np.resize(np.array([np.nan, np.inf, -np.inf], np.float32), v.shape) for k, v in good.items()}
    engine.set_adapter_weights(1, bad)
    engine.snapshot(1, "poison")
    yield
    for key in ("mine", "good", "poison"):
        engine.drop_snapshot(key)
    engine.free_adapter(0)
    engine.free_adapter(1)


def _req(snapshot, seed, **kw):
    return SampleInput(
        prompt=PROMPT,
        num_samples=2,
        max_tokens=kw.pop("max_tokens", 12),
        seed=seed,
        snapshot=snapshot,
        stop_token_ids=[],
        include_prompt_logprobs=True,
        **kw,
    )


def _numbers(res):
    return ([s.tokens for s in res.sequences], [s.logprobs for s in res.sequences], list(res.prompt_logprobs or []))


def _same(a, b):
    ta, la, pa = _numbers(a)
    tb, lb, pb = _numbers(b)
    assert ta == tb
    assert la == lb  # exact: no tolerance
    assert [x for x in pa if x is not None] == [x for x in pb if x is not None]


def test_a_poisoned_snapshot_changes_no_other_row(engine, snapshots):
    # The poisoned row comes first (slots 0-1) and runs longest, so later requests reuse its slots' KV cache (every
    # request here is in one cache-length bucket, 7 + 24 <= 128, so they share one set of slots).
    mine, base = _req("mine", 1), _req(None, 2)
    ref = engine.sample([_req("good", 3, max_tokens=24), mine, base])
    got = engine.sample([_req("poison", 3, max_tokens=24), mine, base])
    _same(got[1], ref[1])
    _same(got[2], ref[2])
    assert not np.isfinite(np.array(got[0].sequences[0].logprobs)).all(), "the owner sees its adapter's NaN"
    # Afterwards, in the slots the poisoned row used: every number as before.
    alone_before = engine.sample([mine, base])
    engine.sample([_req("poison", 4, max_tokens=24)])
    alone_after = engine.sample([mine, base])
    _same(alone_after[0], alone_before[0])
    _same(alone_after[1], alone_before[1])
    assert np.isfinite(np.array(alone_after[1].sequences[0].logprobs)).all()


def test_a_poisoned_slot_changes_no_other_slots_training_numbers(engine, snapshots):
    rng = np.random.default_rng(3)
    toks = rng.integers(1, 300, 10).astype(np.int32)

    def fb(*slots):
        return engine.forward_backward(
            [
                ForwardBackwardInput(
                    slot=s,
                    data=[Datum(toks[:-1], {"target_tokens": toks[1:]})],
                    loss_fn="cross_entropy",
                    forward_only=True,
                )
                for s in slots
            ]
        )

    [ref] = fb(0)
    bad = {k: np.full_like(v, np.nan) for k, v in engine.adapter_weights(1).items()}
    engine.set_adapter_weights(1, bad)
    together = fb(1, 0)
    assert not np.isfinite(together[0].outputs[0]["logprobs"]).all()
    assert together[1].outputs[0]["logprobs"].tolist() == ref.outputs[0]["logprobs"].tolist()
