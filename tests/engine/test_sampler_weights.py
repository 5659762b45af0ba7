"""An ephemeral sampler snapshot outlives the memory that held it (activities/sampler_weights.py): its snapshot op
writes a copy to the claim-check store, and a worker that does not hold it (a successor, or after it was collected)
loads it back by key and samples exactly the same tokens and logprobs for the same seed."""

from __future__ import annotations

import numpy as np
import pytest

from tinkerflow.activities.sampler_weights import KIND, SamplerWeights, decode, encode, object_name
from tinkerflow.common.store import ClaimCheckStore
from tinkerflow.workers.engine.types import InputError, LoraConfig, SampleInput, SlotState


@pytest.fixture
def store(tmp_path) -> ClaimCheckStore:
    return ClaimCheckStore((tmp_path / "store").as_uri())


def _trained_slot(engine, rng) -> None:
    """Slot 0 with weights away from LoRA's init (B = 0 would sample like the base model and prove nothing)."""
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    state = engine.export_slot(0)
    weights = {k: (0.05 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in state.weights.items()}
    zeros = {k: np.zeros_like(v) for k, v in weights.items()}
    trained = SlotState(config=state.config, weights=weights, mu=zeros, nu=dict(zeros), step=0)
    engine.import_slot(0, trained, optimizer=False)


def _sample(engine, key: str):
    (result,) = engine.sample(
        [SampleInput(prompt=np.array([3, 5, 7, 9], np.int32), num_samples=2, max_tokens=6, seed=17, snapshot=key)]
    )
    assert not isinstance(result, Exception), result
    return [(s.tokens, s.logprobs) for s in result.sequences]


def test_the_copy_round_trips_the_config_and_every_weight_bit_for_bit(rng):
    config = LoraConfig(rank=4, seed=None, train_mlp=False, optimizer="adamw")
    weights = {"layers.0.q_proj.lora_a": rng.standard_normal((8, 4)).astype(np.float32)}
    back_config, back = decode(encode(config, weights))
    assert back_config == config and back.keys() == weights.keys()
    np.testing.assert_array_equal(back["layers.0.q_proj.lora_a"], weights["layers.0.q_proj.lora_a"])
    assert object_name("sess-1:sample:0") == "sess-1%3Asample%3A0"  # one flat file name for any key


def test_a_lost_ephemeral_snapshot_is_loaded_back_from_its_copy_and_samples_the_same(engine, store, rng):
    weights = SamplerWeights(engine, store, checkpoints=None)
    _trained_slot(engine, rng)
    key = "sess-dur:sample:0"
    try:
        weights.take(0, key)
        before = _sample(engine, key)
        engine.drop_snapshot(key)  # what a dead worker's successor, or a collection from memory, leaves
        engine.free_adapter(0)  # and the run's slot is gone too: the copy is all there is
        weights.ready(key)  # not evicted here (never held): nothing to do until the Coordinator's load
        weights.load(key)
        assert _sample(engine, key) == before
    finally:
        engine.drop_snapshot(key)


def test_weights_without_a_copy_fail_saying_why_and_a_session_end_deletes_its_copies(engine, store, rng):
    weights = SamplerWeights(engine, store, checkpoints=None)
    with pytest.raises(InputError, match="lost with the JAX worker that held them"):
        weights.load("sess-gone:sample:4")
    with pytest.raises(InputError, match="could not load sampler weights sess-gone:sample:4"):
        weights.ready("sess-gone:sample:4")  # the samples of that batch say the same

    _trained_slot(engine, rng)
    try:
        for n in range(2):
            weights.take(0, f"sess-end:sample:{n}")
        weights.take(0, "sess-other:sample:0")
        weights.drop(["sess-end:sample:0", "sess-end:sample:1"], session_prefix="sess-end:sample:")
        assert sorted(p.rsplit("/", 1)[-1] for p in store.fs.ls(f"{store.root}/{KIND}")) == [
            object_name("sess-other:sample:0")
        ]
    finally:
        weights.drop(["sess-other:sample:0"])
        engine.free_adapter(0)
