"""Adapters paged between the device's training slots and the page store (training/adapter_paging.py, Engine.page)
are exact: a run paged out and back, through host memory or files, in whatever slot it lands, gives the same losses
and the same weights, AdamW moments, step and gradient accumulator as one that stayed resident, compared for
equality, not closeness (a page is a copy of float32 bits; no tolerance applies). Sampler snapshots the device
budget evicts are paged out and back likewise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tinkerflow.workers.engine.runtime.paging_store import PageStore
from tinkerflow.workers.engine.training.adapter_paging import AdapterPager
from tinkerflow.workers.engine.types import (
    AdamConfig,
    Datum,
    ForwardBackwardInput,
    LoraConfig,
    PageMoves,
    SampleInput,
    SlotState,
)

ADAM = AdamConfig(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
LORA = LoraConfig(rank=4, seed=7)


def datums(rng: np.random.Generator) -> list[Datum]:
    out = []
    for n in (7, 12):
        tokens = rng.integers(1, 300, n + 1)
        out.append(
            Datum(
                tokens=tokens[:-1].astype(np.int32),
                inputs={"target_tokens": tokens[1:].astype(np.int64), "weights": rng.random(n).astype(np.float32)},
            )
        )
    return out


def loss(engine, slot: int, batch: list[Datum]) -> float:
    (result,) = engine.forward_backward([ForwardBackwardInput(slot, batch, "cross_entropy")])
    return result.metrics["loss:sum"]


def assert_states_equal(a: SlotState, b: SlotState) -> None:
    assert (a.config, a.step) == (b.config, b.step)
    for field in ("weights", "mu", "nu"):
        x, y = getattr(a, field), getattr(b, field)
        assert x.keys() == y.keys()
        for k in x:
            assert np.array_equal(x[k], y[k]), f"{field} {k} differs"


@pytest.fixture
def free_slots(engine):
    yield
    for slot in list(engine.adapters.configs):
        engine.free_adapter(slot)


def test_a_run_paged_out_and_back_trains_bit_identically_to_one_that_stayed_resident(engine, free_slots, tmp_path):
    batches = [datums(np.random.default_rng(s)) for s in range(4)]
    engine.create_adapter(0, LORA)
    resident = []
    for batch in batches:
        resident.append(loss(engine, 0, batch))
        engine.optim_step(0, ADAM)
    expected_grads = None
    resident.append(loss(engine, 0, batches[0]))  # gradients left in the accumulator
    expected_grads = engine.accumulated_grads(0)
    expected = engine.export_slot(0)
    engine.free_adapter(0)

    # Files too: a second pager over a store with no host memory, so every page goes through a file.
    files = AdapterPager(engine.adapters, PageStore(0, 1 << 30, spill_url=(tmp_path / "pages").as_uri()))
    engine.create_adapter(1, LORA)
    paged, slot = [], 1
    for n, batch in enumerate(batches):
        paged.append(loss(engine, slot, batch))
        # Out with gradients in the accumulator (between forward_backward and optim_step), into another slot.
        target = (slot + 1) % engine.max_lora_adapters
        if n % 2:
            files.page_out(slot, "run")
            assert files.store.where("adapter:run") == "disk"
            files.page_in("run", target)
        else:
            report = engine.page(PageMoves(page_out=((slot, "run"),)))
            assert report.failed == {} and report.resident == 0 and report.paged == 1
            report = engine.page(PageMoves(page_in=(("run", target),)))
            assert report.failed == {} and report.in_tiers == ("host",) and report.resident == 1
        slot = target
        engine.optim_step(slot, ADAM)
        engine.page(PageMoves(page_out=((slot, "run"),), page_in=(("run", slot),)))  # out and back, clean
    paged.append(loss(engine, slot, batches[0]))
    engine.page(PageMoves(page_out=((slot, "run"),)))
    engine.page(PageMoves(page_in=(("run", 3),)))

    assert paged == resident
    assert_states_equal(engine.export_slot(3), expected)
    got_grads = engine.accumulated_grads(3)
    assert all(np.array_equal(got_grads[k], expected_grads[k]) for k in expected_grads)
    assert any(np.any(v) for v in got_grads.values())  # the accumulator really travelled


def test_a_move_that_fails_loses_only_that_adapter_and_says_why(engine, free_slots):
    engine.create_adapter(0, LORA)
    engine.create_adapter(1, LoraConfig(rank=2, seed=1))
    before = engine.export_slot(1)
    report = engine.page(PageMoves(page_out=((1, "b"),), page_in=(("nobody", 0), ("b", 2))))
    assert set(report.failed) == {"nobody"} and "paging its adapter in failed" in report.failed["nobody"]
    assert report.resident == 2 and 0 in engine.adapters.configs  # slot 0 was not free: nothing written over it
    assert_states_equal(engine.export_slot(2), before)
    engine.page(PageMoves(page_out=((2, "b"),)))
    engine.page(PageMoves(drop=("b",)))
    assert "adapter:b" not in engine.pages


def test_a_page_bigger_than_every_budget_fails_the_move_and_frees_the_slot(engine, free_slots):
    tiny = AdapterPager(engine.adapters, PageStore(host_budget_bytes=16))
    engine.create_adapter(0, LORA)
    with pytest.raises(Exception, match="no room to page out adapter"):
        tiny.page_out(0, "r")
    assert 0 not in engine.adapters.configs  # lost on this worker: its run restores it from its snapshot


def test_snapshots_evicted_from_the_device_are_paged_and_sample_the_same(engine, free_slots):
    cache = engine.sampler_snapshots.cache
    budget = cache.budget_bytes
    engine.create_adapter(0, LORA)
    request = SampleInput(prompt=np.array([1, 2, 3], np.int32), max_tokens=6, seed=5, snapshot="s:sample:0")
    try:
        engine.snapshot(0, "s:sample:0")
        (first,) = engine.sample([request])
        cache.budget_bytes = cache.sizes["s:sample:0"]
        loss(engine, 0, datums(np.random.default_rng(1)))
        engine.optim_step(0, ADAM)
        engine.snapshot(0, "s:sample:1")  # evicts s:sample:0 from the device, into the page store
        assert "s:sample:0" not in cache and "snapshot:s:sample:0" in engine.pages
        assert not engine.snapshot_evicted("s:sample:0")
        (again,) = engine.sample([request])
        assert again.sequences[0].tokens == first.sequences[0].tokens
        assert again.sequences[0].logprobs == first.sequences[0].logprobs
        # Both named in one batch: both on the device together for that batch, whatever the budget says.
        both = engine.sample([request, SampleInput(prompt=request.prompt, seed=5, snapshot="s:sample:1")])
        assert all(not isinstance(r, Exception) for r in both)
    finally:
        cache.budget_bytes = budget
        for key in ("s:sample:0", "s:sample:1"):
            engine.drop_snapshot(key)
    assert "snapshot:s:sample:0" not in engine.pages


def test_capacity_counts_whole_pages_of_the_largest_size(engine, tmp_path: Path):
    size = engine.adapter_page_bytes
    store = PageStore(3 * size + size // 2, 2 * size, spill_url=(tmp_path / "p").as_uri())
    assert store.capacity(size) == 5
