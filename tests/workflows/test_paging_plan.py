"""Slots as a cache (workflows/coordinator/paging.py) alone: no server, no workflow, milliseconds.

A hypothesis state machine registers, restarts and loses workers (each with a few slots and a page capacity),
creates, trains in batches and ends runs, fails page moves, and replays every batch's page item on a model of the
worker's slots and page store. After every step: a run is resident in at most one slot and that slot is the one its
placement names; a batch's items find their run's adapter in the slot they name (the worker model checks it); a run
with an item in the batch is never paged out by it; no worker holds more runs than its slots and pages; a create
is refused only when no worker has room; the least recently used run is the one paged out."""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from temporalio.exceptions import ApplicationError

from tinkerflow.workflows.coordinator.paging import BatchPlan
from tinkerflow.workflows.coordinator.placement import PlacementPolicy
from tinkerflow.workflows.coordinator.state import CoordinatorState
from tinkerflow.workflows.protocol.messages import LoraSpec, ModelCard, TenantLimit, WorkerInfo, WorkItem, WorkKind

CARD = ModelCard(name="m", arch="qwen3", local_path="/m", vocab_size=64, max_context=128)
QUEUES = ["q1", "q2"]


def worker(queue: str, slots: int, paged: int, incarnation: str) -> WorkerInfo:
    return WorkerInfo(
        worker_id=queue,
        task_queue=queue,
        max_adapters=slots,
        max_rank=8,
        card=CARD,
        incarnation=incarnation,
        max_paged=paged,
    )


def item(kind: WorkKind, model_id: str, n: int = 0, **fields) -> WorkItem:
    return WorkItem(key=f"{model_id}#{kind}#{n}", requester=f"run/{model_id}", kind=kind, model_id=model_id, **fields)


def create_item(model_id: str, owner: str = "o", limit: int = 0) -> WorkItem:
    return item(WorkKind.CREATE_ADAPTER, model_id, lora=LoraSpec(rank=4), tenant=TenantLimit(owner, limit))


def test_the_least_recently_used_run_without_work_in_the_batch_is_paged_out() -> None:
    p = PlacementPolicy(CoordinatorState(base_model="m", pool="default"), "coordinator/m/default")
    p.register(worker("q1", 2, 10, "a"))
    batch = BatchPlan(p.s, "q1")
    for m in ("a", "b"):
        assert p.route(create_item(m), set(), 0.0)[0] == "q1"
        assert batch.admit(p.route(create_item(m), set(), 0.0)[1]) is not None
    assert batch.page_item("k", "me") is None  # two free slots: nothing to move
    batch = BatchPlan(p.s, "q1")
    batch.admit(p.route(item(WorkKind.FORWARD_BACKWARD, "a"), set(), 0.0)[1])  # a is used again: b is older
    admitted = batch.admit(p.route(create_item("c"), set(), 0.0)[1])
    assert admitted is not None and admitted.slot == 1 and p.s.placements["b"] == ["q1", -1]
    assert batch.admit(p.route(create_item("d"), set(), 0.0)[1]) is None  # a and c are both in this batch
    head = batch.page_item("k", "me")
    assert head is not None and head.page is not None
    assert [(m.model_id, m.slot) for m in head.page.page_out] == [("b", 1)] and head.page.page_in == []
    batch = BatchPlan(p.s, "q1")
    back = batch.admit(p.route(item(WorkKind.OPTIM_STEP, "b"), set(), 0.0)[1])
    assert back is not None and back.slot == 0 and p.s.placements["a"] == ["q1", -1]  # a is now the oldest
    assert (p.s.page_ins, p.s.page_outs) == (1, 2)


class PagingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.p = PlacementPolicy(CoordinatorState(base_model="m", pool="default"), "coordinator/m/default")
        self.generation = 0
        # The workers as the engine sees them: queue -> (slot -> run, paged runs).
        self.engines: dict[str, tuple[dict[int, str], set[str]]] = {}
        self.live: dict[str, str] = {}  # run -> queue, while it has an adapter somewhere

    @rule(queue=st.sampled_from(QUEUES), slots=st.integers(1, 3), paged=st.integers(0, 4))
    def register(self, queue: str, slots: int, paged: int) -> None:
        self.generation += 1
        assert self.p.register(worker(queue, slots, paged, str(self.generation)))
        self.engines[queue] = ({}, set())
        self.live = {m: q for m, q in self.live.items() if q != queue}

    @rule(queue=st.sampled_from(QUEUES))
    def die(self, queue: str) -> None:
        if queue in self.p.s.workers:
            assert self.p.lose_worker(queue, self.p.s.workers[queue].info.incarnation)
            del self.engines[queue]
            self.live = {m: q for m, q in self.live.items() if q != queue}

    @rule(
        runs=st.lists(st.integers(0, 9), min_size=1, max_size=6),
        kinds=st.lists(st.sampled_from([WorkKind.FORWARD_BACKWARD, WorkKind.OPTIM_STEP, WorkKind.CREATE_ADAPTER])),
        fail=st.sets(st.integers(0, 9)),
    )
    def batch(self, runs: list[int], kinds: list[WorkKind], fail: set[int]) -> None:
        """One batch per worker from the pending items of these runs (a new run's item is its create), as
        _take_for builds them: what one worker's batch does not take stays pending for the next."""
        pending: list[WorkItem] = []
        for n, r in enumerate(runs):
            model = f"s:train:{r}"
            kind = kinds[n] if n < len(kinds) and model in self.p.s.placements else WorkKind.CREATE_ADAPTER
            pending.append(create_item(model) if kind is WorkKind.CREATE_ADAPTER else item(kind, model, n))
        for queue in list(self.p.s.workers):
            plan = BatchPlan(self.p.s, queue, wanted={i.model_id for i in pending})
            taken: list[WorkItem] = []
            for it in list(pending):
                room_before = self._room()
                try:
                    target, routed = self.p.route(it, set(), 0.0)
                except ApplicationError as e:
                    assert e.type == "AdapterLost" or not room_before, e.message
                    pending.remove(it)  # answered
                    continue
                if target != queue:
                    continue
                admitted = plan.admit(routed)
                if admitted is None:
                    assert len(plan.pinned) == self.p.s.workers[queue].info.max_adapters or (
                        self.p.s.workers[queue].info.max_paged == 0
                    )
                    continue
                pending.remove(it)
                taken.append(admitted)
            head = plan.page_item("page", "me")
            if head is not None and head.page is not None:
                event(f"page moves: out {len(head.page.page_out)}, in {len(head.page.page_in)}")
            # The worker model asserts every taken item finds its run in its slot once the moves ran: a run with an
            # item in the batch paged out after it was admitted would fail there.
            lost = self._run_on_engine(queue, head, taken, {f"s:train:{r}" for r in fail})
            if head is not None:
                self.p.after(head, True, sorted(lost))
            for it in taken:
                if it.kind is WorkKind.CREATE_ADAPTER and it.model_id not in lost:
                    self.live[it.model_id] = queue

    def _run_on_engine(self, queue: str, head: WorkItem | None, taken: list[WorkItem], fail: set[str]) -> set[str]:
        slots, pages = self.engines[queue]
        lost: set[str] = set()
        if head is not None and head.page is not None:
            for move in head.page.page_out:
                assert slots.pop(move.slot) == move.model_id  # the occupant the Coordinator believes in
                pages.add(move.model_id)
            for move in head.page.page_in:
                assert move.slot not in slots and move.model_id in pages
                pages.discard(move.model_id)
                if move.model_id in fail:
                    lost.add(move.model_id)
                    self.live.pop(move.model_id, None)
                else:
                    slots[move.slot] = move.model_id
            for model in head.page.drop:
                pages.discard(model)
        for it in taken:
            if it.model_id in lost:
                continue  # the worker answers it as lost
            if it.kind is WorkKind.CREATE_ADAPTER:
                slots[it.slot] = it.model_id
            else:
                assert slots.get(it.slot) == it.model_id, f"{it.kind} of {it.model_id} on the wrong slot"
        return lost

    @rule(r=st.integers(0, 9))
    def end(self, r: int) -> None:
        model = f"s:train:{r}"
        try:
            target, routed = self.p.route(item(WorkKind.FREE_ADAPTER, model), set(), 0.0)
        except ApplicationError:
            assert model not in self.live
            return
        assert target is not None
        admitted = BatchPlan(self.p.s, target).admit(routed)
        assert admitted is not None
        slots, pages = self.engines[target]
        if admitted.slot < 0:
            pages.remove(model)
        else:
            assert slots.pop(admitted.slot) == model
        self.p.after(admitted, True)
        self.live.pop(model, None)

    def _room(self) -> bool:
        live: dict[str, int] = {}
        for q, _ in self.p.s.placements.values():
            live[q] = live.get(q, 0) + 1
        return any(live.get(q, 0) < w.info.max_adapters + w.info.max_paged for q, w in self.p.s.workers.items())

    @invariant()
    def one_home_each_and_the_engines_agree(self) -> None:
        s = self.p.s
        for queue, w in s.workers.items():
            slots, pages = self.engines[queue]
            resident = {int(k): m for k, m in w.slots.items()}
            assert resident == slots  # the Coordinator's record is the worker's truth
            assert len(slots) <= w.info.max_adapters
            here = {m for m, (q, _) in s.placements.items() if q == queue}
            assert len(here) <= w.info.max_adapters + w.info.max_paged
            assert {m for m in here if s.placements[m][1] < 0} == pages
            for m in here:
                slot = s.placements[m][1]
                assert slot < 0 or slots[slot] == m
        assert set(s.placements) == set(self.live)


TestPagingMachine = PagingMachine.TestCase
TestPagingMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
