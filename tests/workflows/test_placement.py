"""The Coordinator's placement policy (workflows/coordinator/placement.py) alone: no server, no workflow, milliseconds.

A hypothesis state machine drives workers registering, restarting and dying and runs creating, using and freeing
adapters, and checks after every step: never two runs in one slot, never past a worker's max_adapters, placements
and slots agree both ways, and a live worker's placements never move."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from temporalio.exceptions import ApplicationError

from tinkerflow.workflows.coordinator.placement import EPHEMERAL_SNAPSHOT_IDLE_S, PlacementPolicy
from tinkerflow.workflows.coordinator.state import CoordinatorState
from tinkerflow.workflows.protocol.messages import (
    DropSnapshots,
    LoraSpec,
    ModelCard,
    SampleParams,
    WorkerInfo,
    WorkItem,
    WorkKind,
)

CARD = ModelCard(name="m", arch="qwen3", local_path="/m", vocab_size=64, max_context=128)


def worker(queue: str, max_adapters: int = 2, incarnation: str = "a") -> WorkerInfo:
    return WorkerInfo(
        worker_id=queue, task_queue=queue, max_adapters=max_adapters, max_rank=8, card=CARD, incarnation=incarnation
    )


def item(kind: WorkKind, model_id: str = "", n: int = 0, **fields) -> WorkItem:
    return WorkItem(key=f"{model_id}#{n}", requester=f"run/{model_id}", kind=kind, model_id=model_id, **fields)


def create(p: PlacementPolicy, model_id: str) -> tuple[str | None, int]:
    queue, routed = p.route(item(WorkKind.CREATE_ADAPTER, model_id, lora=LoraSpec(rank=4)), set(), 0.0)
    return queue, routed.slot


def placement(*workers: WorkerInfo) -> PlacementPolicy:
    p = PlacementPolicy(CoordinatorState(base_model="m", pool="default"), "coordinator/m/default")
    for w in workers:
        p.register(w)
    return p


def test_adapters_spread_over_workers_and_fill_the_lowest_free_slot() -> None:
    p = placement(worker("q1"), worker("q2"))
    assert [create(p, f"s:train:{n}") for n in range(4)] == [("q1", 0), ("q2", 0), ("q1", 1), ("q2", 1)]
    with pytest.raises(ApplicationError, match=r"no free LoRA adapter slot.*all 4 are in use"):
        create(p, "s:train:9")
    p.after(item(WorkKind.FREE_ADAPTER, "s:train:0"), ok=True)
    assert create(p, "s:train:9") == ("q1", 0)
    assert create(p, "s:train:9") == ("q1", 0)  # a retried create finds its placement


def test_work_on_a_run_goes_to_its_slot_and_a_lost_adapter_says_so() -> None:
    p = placement(worker("q1"), worker("q2"))
    create(p, "a:train:0")
    create(p, "b:train:0")
    queue, routed = p.route(item(WorkKind.FORWARD_BACKWARD, "b:train:0"), set(), 0.0)
    assert (queue, routed.slot) == ("q2", 0)
    assert p.lose_worker("q2", "a")
    with pytest.raises(ApplicationError) as lost:
        p.route(item(WorkKind.OPTIM_STEP, "b:train:0"), set(), 0.0)
    assert lost.value.type == "AdapterLost"
    assert p.s.placements == {"a:train:0": ["q1", 0]}
    assert not p.lose_worker("q1", "an older process")  # a worker that came back is not dropped by a stale failure


def test_samples_follow_their_snapshot_and_saved_weights_load_first_on_the_least_busy_worker() -> None:
    p = placement(worker("q1"), worker("q2"))
    create(p, "s:train:0")
    create(p, "s:train:1")
    p.route(item(WorkKind.SNAPSHOT, "s:train:1", snapshot="s:sample:0"), set(), 10.0)
    queue, _ = p.route(item(WorkKind.SAMPLE, n=1, snapshot="s:sample:0", sample=SampleParams()), {"q2"}, 11.0)
    assert queue == "q2"  # where the snapshot lives, busy or not
    p.reload_ephemeral = lambda: False  # as histories from before the reload patch
    with pytest.raises(ApplicationError, match="not loaded on any worker"):
        p.route(item(WorkKind.SAMPLE, n=2, snapshot="s:sample:9"), set(), 11.0)
    saved = item(WorkKind.SAMPLE, n=3, snapshot="tinker://s:train:0/sampler_weights/w")
    queue, routed = p.route(saved, {"q1"}, 12.0)
    assert queue == "q2"
    (load,) = p.loads_for(routed, queue, 12.0, lambda path: f"load-{path}")
    assert load.kind is WorkKind.LOAD_SNAPSHOT and load.load is not None and load.load.path == saved.snapshot
    assert p.loads_for(routed, queue, 13.0, lambda path: "again") == []  # loaded once per worker
    assert p.route(item(WorkKind.SAMPLE, n=4), {"q1"}, 0.0)[0] == "q2"  # the base model: the least busy worker


def test_an_ephemeral_snapshot_no_worker_holds_is_loaded_from_its_copy_first() -> None:
    """Its worker died, or its memory copy was collected: the least busy worker loads it by key (the copy its
    snapshot op wrote) in the same batch; histories from before the patch answered it as an error."""
    p = placement(worker("q1"), worker("q2"))
    create(p, "s:train:0")
    p.route(item(WorkKind.SNAPSHOT, "s:train:0", snapshot="s:sample:0"), set(), 1.0)
    assert p.lose_worker("q1", "a")  # its holder died: the record forgets it
    sample = item(WorkKind.SAMPLE, n=1, snapshot="s:sample:0", sample=SampleParams())
    queue, routed = p.route(sample, set(), 2.0)
    assert queue == "q2"
    (load,) = p.loads_for(routed, queue, 2.0, lambda key: f"load-{key}")
    assert load.kind is WorkKind.LOAD_SNAPSHOT and load.load is not None and load.load.path == "s:sample:0"
    assert p.s.snapshots == {"s:sample:0": "q2"} and p.loads_for(routed, queue, 3.0, lambda key: "again") == []
    p.after(load, ok=False)  # no copy to load: forgotten, the sample's error says why (the worker's answer)
    assert p.s.snapshots == {}
    p.lose_worker("q2", "a")
    assert p.route(sample, set(), 4.0) == (None, sample)  # no worker at all: it waits for one to register

    before = placement(worker("q1"))
    before.reload_ephemeral = lambda: False
    with pytest.raises(ApplicationError, match="not loaded on any worker"):
        before.route(sample, set(), 2.0)


def test_a_session_prefix_is_resolved_into_the_keys_the_record_holds() -> None:
    p = placement(worker("q1"))
    create(p, "s:train:0")
    for n in range(2):
        p.route(item(WorkKind.SNAPSHOT, "s:train:0", n, snapshot=f"s:sample:{n}"), set(), float(n))
    queue, routed = p.route(item(WorkKind.DROP_SNAPSHOTS, drop=DropSnapshots(prefix="s:sample:")), set(), 5.0)
    assert queue == "q1" and routed.drop is not None and routed.drop.keys == ["s:sample:0", "s:sample:1"]
    assert p.s.snapshots == {}
    with pytest.raises(ApplicationError, match="no snapshots with prefix"):
        p.route(item(WorkKind.DROP_SNAPSHOTS, drop=DropSnapshots(prefix="s:sample:")), set(), 5.0)


@pytest.mark.parametrize("every_holder", [True, False])
def test_a_sessions_snapshots_on_several_workers_are_dropped_on_each(every_holder: bool) -> None:
    p = placement(worker("q1", 1), worker("q2", 1))
    p.drop_on_every_holder = lambda: every_holder  # False: what histories recorded before the patch did
    for n in range(2):
        create(p, f"s:train:{n}")
        p.route(item(WorkKind.SNAPSHOT, f"s:train:{n}", n, snapshot=f"s:sample:{n}"), set(), 0.0)
    queue, routed = p.route(item(WorkKind.DROP_SNAPSHOTS, "", 9, drop=DropSnapshots(prefix="s:")), set(), 1.0)
    assert queue == "q1" and routed.drop is not None and routed.drop.keys == ["s:sample:0"] and p.s.snapshots == {}
    if every_holder:
        (other,) = p.s.pending
        assert p.route(other, set(), 1.0)[0] == "q2" and other.drop == DropSnapshots(keys=["s:sample:1"], queue="q2")
    else:
        assert p.s.pending == []


def test_a_runs_older_ephemeral_snapshots_are_collected_once_idle() -> None:
    p = placement(worker("q1"))
    create(p, "s:train:0")
    p.route(item(WorkKind.SNAPSHOT, "s:train:0", 1, snapshot="s:sample:1"), set(), 0.0)
    p.route(item(WorkKind.SNAPSHOT, "s:train:0", 2, snapshot="s:sample:2"), set(), 1.0)
    assert p.s.pending == []  # s:sample:1 was used 1 s ago
    p.route(item(WorkKind.SNAPSHOT, "s:train:0", 3, snapshot="s:sample:3"), set(), EPHEMERAL_SNAPSHOT_IDLE_S + 5)
    (drop,) = p.s.pending
    assert drop.kind is WorkKind.DROP_SNAPSHOTS and drop.requester == "coordinator/m/default"
    assert drop.drop == DropSnapshots(keys=["s:sample:1", "s:sample:2"], queue="q1")
    assert set(p.s.snapshots) == {"s:sample:3"}


class PlacementMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.p = placement()
        self.incarnations: dict[str, int] = {}
        self.expected: dict[str, list] = {}  # model_id -> [queue, slot] the policy gave it, while it lives

    @rule(queue=st.sampled_from(["q1", "q2", "q3"]), max_adapters=st.integers(1, 4), restart=st.booleans())
    def register(self, queue: str, max_adapters: int, restart: bool) -> None:
        if queue in self.incarnations and not restart:
            info = self.p.s.workers[queue].info if queue in self.p.s.workers else None
            if info is not None:
                assert not self.p.register(info)  # the periodic re-registration changes nothing
                return
        self.incarnations[queue] = self.incarnations.get(queue, 0) + 1
        assert self.p.register(worker(queue, max_adapters, str(self.incarnations[queue])))
        self.expected = {m: at for m, at in self.expected.items() if at[0] != queue}  # a restart lost them

    @rule(queue=st.sampled_from(["q1", "q2", "q3"]))
    def die(self, queue: str) -> None:
        if queue in self.p.s.workers:
            assert self.p.lose_worker(queue, self.p.s.workers[queue].info.incarnation)
            self.expected = {m: at for m, at in self.expected.items() if at[0] != queue}

    @rule(n=st.integers(0, 11))
    def create_adapter(self, n: int) -> None:
        model_id = f"s{n}:train:0"
        free = sum(w.info.max_adapters - len(w.slots) for w in self.p.s.workers.values())
        loads = {q: len(w.slots) for q, w in self.p.s.workers.items() if len(w.slots) < w.info.max_adapters}
        try:
            queue, slot = create(self.p, model_id)
        except ApplicationError:
            assert free == 0 and model_id not in self.expected
            return
        if queue is None:
            assert not self.p.s.workers
            return
        if model_id in self.expected:
            assert self.expected[model_id] == [queue, slot]  # a retry keeps its slot
        else:
            assert loads[queue] == min(loads.values())  # placed on a least-loaded worker with a free slot
        self.expected[model_id] = [queue, slot]

    @rule(n=st.integers(0, 11), ok=st.booleans())
    def free_adapter(self, n: int, ok: bool) -> None:
        model_id = f"s{n}:train:0"
        try:
            self.p.route(item(WorkKind.FREE_ADAPTER, model_id), set(), 0.0)
        except ApplicationError:
            assert model_id not in self.expected
            return
        self.p.after(item(WorkKind.FREE_ADAPTER, model_id), ok)  # freed whatever the engine said
        self.expected.pop(model_id)

    @rule(n=st.integers(0, 11))
    def train(self, n: int) -> None:
        model_id = f"s{n}:train:0"
        try:
            queue, routed = self.p.route(item(WorkKind.FORWARD_BACKWARD, model_id), set(), 0.0)
        except ApplicationError as e:
            assert model_id not in self.expected and e.type == "AdapterLost"
            return
        assert [queue, routed.slot] == self.expected[model_id]

    @invariant()
    def slots_and_placements_agree(self) -> None:
        s = self.p.s
        seen = set()
        for queue, w in s.workers.items():
            assert len(w.slots) <= w.info.max_adapters
            for slot, model_id in w.slots.items():
                assert 0 <= int(slot) < w.info.max_adapters
                assert s.placements[model_id] == [queue, int(slot)]
                assert model_id not in seen  # one slot per run
                seen.add(model_id)
        assert set(s.placements) == seen
        assert s.placements == self.expected  # stable while the worker lives; gone with it


TestPlacementMachine = PlacementMachine.TestCase
TestPlacementMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
