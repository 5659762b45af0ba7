"""Sampler snapshots under a byte budget (workers/engine/sampling/snapshots.py): least recently used out first, a clear
error for an evicted ephemeral snapshot the page store had no room for, saved weights reloaded on demand."""

from __future__ import annotations

from typing import cast

import numpy as np

from tinkerflow.workers.engine.interface import EngineApi
from tinkerflow.workers.engine.runtime.paging_store import PageStore
from tinkerflow.workers.engine.sampling.snapshots import SnapshotCache
from tinkerflow.workers.engine.types import InputError, LoraConfig, SampleInput


def test_least_recently_used_is_evicted_first_and_the_newest_always_stays():
    cache = SnapshotCache(budget_bytes=2 * 4000)
    cache["a"] = np.zeros(1000, np.float32)  # 4,000 bytes each
    cache["b"] = np.zeros(1000, np.float32)
    _ = cache["a"]  # sampled: now the most recently used
    cache["c"] = np.zeros(1000, np.float32)
    assert list(cache) == ["a", "c"] and list(cache.evicted) == ["b"] and cache.total_bytes == 8000
    cache["huge"] = np.zeros(10_000, np.float32)  # alone over the budget: kept, everything older goes
    assert list(cache) == ["huge"] and set(cache.evicted) == {"a", "b", "c"}
    cache.pop("huge")
    assert cache.total_bytes == 0 and "huge" not in cache.evicted  # dropped on purpose is not "evicted"


def test_an_evicted_ephemeral_snapshot_with_no_room_to_page_fails_its_sample_saying_why(engine):
    """The real engine: snapshots of one slot under a budget of two and a page store with no room (full of training
    adapters, say); the first one's sample fails clearly. (With room it is paged: test_adapter_paging.py.)"""
    budget = engine.sampler_snapshots.cache.budget_bytes
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    engine.sampler_snapshots.attach_pages(PageStore(host_budget_bytes=0))
    try:
        engine.snapshot(0, "s:sample:0")
        engine.sampler_snapshots.cache.budget_bytes = 2 * engine.sampler_snapshots.cache.sizes["s:sample:0"]
        engine.snapshot(0, "s:sample:1")
        engine.snapshot(0, "s:sample:2")
        assert engine.snapshot_evicted("s:sample:0") and not engine.snapshot_evicted("s:sample:2")
        (result,) = engine.sample([SampleInput(prompt=np.array([1, 2], np.int32), snapshot="s:sample:0")])
        assert isinstance(result, InputError)
        assert "were evicted from this JAX worker's snapshot memory" in str(result)
        assert "--snapshot-budget-mb" in str(result) and "--adapter-host-memory-mb" in str(result)
    finally:
        engine.sampler_snapshots.attach_pages(engine.pages)
        engine.sampler_snapshots.cache.budget_bytes = budget
        for key in ("s:sample:0", "s:sample:1", "s:sample:2"):
            engine.drop_snapshot(key)
        engine.free_adapter(0)


def test_evicted_saved_weights_are_read_again_before_the_sample(tmp_path, monkeypatch):
    from tinkerflow.activities import checkpoint_io, wire
    from tinkerflow.activities.engine_activities import EngineActivities
    from tinkerflow.common.checkpoints import CheckpointStore
    from tinkerflow.common.store import ClaimCheckStore
    from tinkerflow.workflows.protocol.messages import WorkItem
    from tinkerflow.workflows.protocol.work import WorkKind

    path = "tinker://s:train:0/sampler_weights/w"
    reloaded, sampled = [], []

    class Engine:  # only what the sample path touches
        def snapshot_evicted(self, key):
            return key not in reloaded

        def sample(self, inputs):
            sampled.extend(i.snapshot for i in inputs)
            return [InputError("stop here")] * len(inputs)

    monkeypatch.setattr(checkpoint_io, "load_snapshot", lambda _e, _c, key: reloaded.append(key))
    monkeypatch.setattr(
        wire, "sample_input", lambda _body, snapshot, _images: SampleInput(prompt=np.array([1]), snapshot=snapshot)
    )
    store = ClaimCheckStore((tmp_path / "store").as_uri())
    # A partial fake: the sample path reaches only snapshot_evicted and sample.
    acts = EngineActivities(cast(EngineApi, Engine()), store, checkpoints=CheckpointStore((tmp_path / "ckpt").as_uri()))
    item = WorkItem(key="k", requester="r", kind=WorkKind.SAMPLE, payload=store.put(b"{}", "requests"), snapshot=path)
    acts._sample([item])
    assert reloaded == [path] and sampled == [path]
