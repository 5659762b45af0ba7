"""The page store (workers/engine/runtime/paging_store.py) alone: numpy pages, host memory and files, no JAX.

A hypothesis state machine puts, takes and drops adapter and snapshot pages of random sizes under small budgets
and checks after every step: neither tier ever holds more than its budget, an adapter page is never lost (taken
back bit-identical, wherever it went), a snapshot page comes back bit-identical or not at all, and the counts agree
with what is there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tinkerflow.workers.engine.runtime.paging_store import Page, PagesFull, PageStore


def page(kind: str, n: int, seed: int) -> Page:
    rng = np.random.default_rng(seed)
    arrays = {"lora/a": rng.standard_normal(n).astype(np.float32), "mu/a": rng.standard_normal(n).astype(np.float32)}
    arrays["lora/a"][0] = np.nan  # every bit pattern travels, NaN too
    return Page(kind=kind, arrays=arrays, meta={"count": seed, "config": {"rank": 4}})  # type: ignore[arg-type]


def same(a: Page, b: Page) -> bool:
    return (
        a.kind == b.kind
        and a.meta == b.meta
        and a.arrays.keys() == b.arrays.keys()
        and all(a.arrays[k].tobytes() == b.arrays[k].tobytes() for k in a.arrays)
        and all(a.arrays[k].dtype == b.arrays[k].dtype for k in a.arrays)
    )


def test_pages_fill_host_memory_then_files_and_come_back_from_either(tmp_path: Path) -> None:
    one = page("adapter", 100, 0).nbytes  # 800 bytes
    store = PageStore(host_budget_bytes=2 * one, disk_budget_bytes=2 * one, spill_url=(tmp_path / "p").as_uri())
    assert store.capacity(one) == 4
    pages = {f"r{i}": page("adapter", 100, i) for i in range(4)}
    for key, p in pages.items():
        store.put(key, p)
    # The two paged out first went to files; the newest two are in host memory.
    assert [store.where(k) for k in pages] == ["disk", "disk", "host", "host"]
    assert len(list((tmp_path / "p").glob("*.npz"))) == 2
    with pytest.raises(PagesFull, match=r"--adapter-host-memory-mb.*--adapter-disk-mb"):
        store.put("r4", page("adapter", 100, 4))
    assert "r4" not in store and len(store) == 4  # nothing stored, nothing lost
    for key in ("r0", "r3"):
        assert same(store.take(key), pages[key])
    assert store.counts.read_from_disk == 1 and len(list((tmp_path / "p").glob("*.npz"))) == 1


def test_snapshots_make_way_for_adapters_and_a_restarted_store_starts_empty(tmp_path: Path) -> None:
    one = page("adapter", 100, 0).nbytes
    url = (tmp_path / "p").as_uri()
    store = PageStore(host_budget_bytes=one, disk_budget_bytes=one, spill_url=url)
    store.put("s0", page("snapshot", 100, 0))
    store.put("s1", page("snapshot", 100, 1))  # s0 spills to a file
    store.put("r0", page("adapter", 100, 2))  # s1 spills, s0 is dropped from the file tier to make room
    assert ("s0" in store, store.where("s1"), store.where("r0")) == (False, "disk", "host")
    store.put("r1", page("adapter", 100, 3))  # r0 must spill: the snapshot file goes
    assert (store.where("r0"), store.where("r1"), "s1" in store) == ("disk", "host", False)
    assert store.counts.dropped == 2
    again = PageStore(host_budget_bytes=one, disk_budget_bytes=one, spill_url=url)
    assert len(again) == 0 and not list((tmp_path / "p").glob("*.npz"))


class Pages(RuleBasedStateMachine):
    keys = st.sampled_from([f"k{i}" for i in range(6)])

    @initialize(host=st.integers(0, 4), disk=st.integers(0, 4))
    def make(self, host: int, disk: int) -> None:
        import tempfile

        self.unit = page("adapter", 10, 0).nbytes
        self.dir = tempfile.mkdtemp(prefix="pages-")
        self.store = PageStore(host * self.unit, disk * self.unit, spill_url=Path(self.dir).as_uri())
        self.model: dict[str, Page] = {}  # what must (adapters) or may (snapshots) be there

    @rule(key=keys, kind=st.sampled_from(["adapter", "snapshot"]), size=st.sampled_from([5, 10]), seed=st.integers())
    def put(self, key: str, kind: str, size: int, seed: int) -> None:
        p = page(kind, size, seed % 1000)
        try:
            self.store.put(key, p)
        except PagesFull:
            assert kind == "adapter"
            assert key not in self.store
            self.model.pop(key, None)  # put replaces: the old page of this key was dropped first
            return
        self.model[key] = p

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data())
    def take(self, data) -> None:
        key = data.draw(st.sampled_from(sorted(self.model)))
        expected = self.model.pop(key)
        if key in self.store:
            assert same(self.store.take(key), expected)
        else:
            assert expected.kind == "snapshot", f"adapter page {key} was lost"

    @rule(key=keys)
    def drop(self, key: str) -> None:
        self.store.drop(key)
        self.model.pop(key, None)

    @invariant()
    def within_budgets_and_counted(self) -> None:
        s = self.store
        assert s.counts.host_bytes <= s.host_budget and s.counts.disk_bytes <= s.disk_budget
        assert s.counts.host_pages + s.counts.disk_pages == len(s)
        for key, p in self.model.items():
            assert key in s or p.kind == "snapshot", f"adapter page {key} was lost"
        assert set(s.keys()) <= set(self.model)


Pages.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPages = Pages.TestCase
