"""Slots as a cache (workflows/coordinator/paging.py) on the real workflows and a local Temporal server, with a mocked
JAX worker that models its slots and page store: it refuses any work on a slot that does not hold the item's run, so
every answer below also proves the Coordinator paged the right adapter in first.

More runs than slots all train, each on its own state; a create is refused only past the owner's live-run limit or
the workers' page capacity, with a message that says which; one tenant churning many runs does not delay another's
op past the next batch; a page move the worker fails makes that run restore itself, and nothing hangs."""

from __future__ import annotations

import asyncio

from mock_engine import MockEngine, fwd_flags
from wf_harness import Tinker, eventually, within

from tinkerflow.workflows.coordinator.placement import SLOT_KINDS
from tinkerflow.workflows.coordinator.workflow import PATCH_PAGING
from tinkerflow.workflows.protocol.messages import AdamSpec, Batch, BatchResult, Outcome, RunState, TrainingOp, WorkItem
from tinkerflow.workflows.protocol.work import OpKind, WorkKind
from tinkerflow.workflows.training_run import TrainingRunWorkflow


class SlotEngine(MockEngine):
    """The mocked worker with slots and a page store: each run's state is its optimizer step count, and a
    forward_backward's loss is 1 / (1 + steps), so a run trained on another run's adapter would show it."""

    def __init__(self, fail_page_in: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.slots: dict[int, str] = {}
        self.pages: set[str] = set()
        self.steps: dict[str, int] = {}
        self.fail_page_in = set(fail_page_in)
        self.wrong: list[str] = []  # items that named a slot not holding their run (must stay empty)

    async def run_batch(self, batch: Batch) -> BatchResult:
        self.lost: dict[str, str] = {}  # as the JAX worker does: a failed page-in fails the run's later items
        return await super().run_batch(batch)

    def answer(self, item: WorkItem) -> Outcome:
        if item.kind is WorkKind.PAGE:
            return self._page(item)
        if item.model_id in self.lost:
            return Outcome(error=self.lost[item.model_id], category="server", worker_lost=True)
        if item.kind is WorkKind.CREATE_ADAPTER:
            self.slots[item.slot] = item.model_id
            self.steps[item.model_id] = 0
            return Outcome(json={"slot": item.slot})
        if item.kind is WorkKind.FREE_ADAPTER:
            if item.slot < 0:
                self.pages.discard(item.model_id)
            elif self.slots.get(item.slot) == item.model_id:
                del self.slots[item.slot]
            return Outcome(json={})
        if item.kind in SLOT_KINDS and self.slots.get(item.slot) != item.model_id:
            self.wrong.append(f"{item.kind} of {item.model_id} on slot {item.slot} holding {self.slots.get(item.slot)}")
            return Outcome.failed(f"slot {item.slot} does not hold {item.model_id}", "server")
        if item.kind is WorkKind.FORWARD_BACKWARD and "hold" not in fwd_flags(item):
            loss = 1.0 / (1 + self.steps[item.model_id])
            return Outcome(json={"loss": loss, "tokens": 3}, blob=super().answer(item).blob)
        if item.kind is WorkKind.OPTIM_STEP:
            self.steps[item.model_id] += 1
        return super().answer(item)

    def _page(self, item: WorkItem) -> Outcome:
        assert item.page is not None
        failed: dict[str, str] = {}
        for move in item.page.page_out:
            if self.slots.get(move.slot) != move.model_id:
                self.wrong.append(f"page out {move.model_id} from slot {move.slot} holding {self.slots.get(move.slot)}")
            self.slots.pop(move.slot, None)
            self.pages.add(move.model_id)
        for move in item.page.page_in:
            if move.model_id in self.fail_page_in:
                self.fail_page_in.discard(move.model_id)
                self.pages.discard(move.model_id)
                failed[move.model_id] = "the page file could not be read"
                continue
            if move.slot in self.slots or move.model_id not in self.pages:
                self.wrong.append(f"page in {move.model_id} to slot {move.slot} holding {self.slots.get(move.slot)}")
            self.pages.discard(move.model_id)
            self.slots[move.slot] = move.model_id
        for model_id in item.page.drop:
            self.pages.discard(model_id)
        self.lost.update(failed)
        return Outcome(json={"failed": failed})


def optim(seq_id: int) -> TrainingOp:
    return TrainingOp(seq_id=seq_id, kind=OpKind.OPTIM_STEP, body_hash=f"optim-{seq_id}", adam=AdamSpec(1e-3))


async def _round(tinker: Tinker, runs: dict[str, object], seq: int) -> dict[str, float]:
    """One forward_backward + optim_step on every run at once; each run's loss."""

    async def one(run) -> float:
        out = await tinker.op(run, tinker.fwd(seq))
        assert out.ok, out
        loss = (await run.query(TrainingRunWorkflow.describe)).last_loss  # the run's record of its last loss
        assert (await tinker.op(run, optim(seq + 1))).ok
        return loss

    losses = await within(asyncio.gather(*(one(run) for run in runs.values())), timeout=120)
    return dict(zip(runs, losses, strict=True))


async def test_more_runs_than_slots_all_train_each_on_its_own_adapter(tinker_factory) -> None:
    engine = SlotEngine()
    async with tinker_factory(max_adapters=2, max_paged=100, engine=engine) as tinker:
        sessions = [(await tinker.start_session())[0] for _ in range(2)]
        created = await within(asyncio.gather(*(tinker.create_run(sessions[n % 2], n) for n in range(7))), timeout=120)
        assert all(outcome.ok for _, outcome in created), [o for _, o in created]
        runs = {handle.id: handle for handle, _ in created}
        for step in range(3):
            losses = await _round(tinker, runs, 1 + 2 * step)
            assert set(losses.values()) == {1.0 / (1 + step)}, losses  # each run's own step count
        assert engine.wrong == []
        for batch in engine.batches:
            slot_runs = {i.model_id for i in batch.items if i.kind in SLOT_KINDS | {WorkKind.CREATE_ADAPTER}}
            assert len(slot_runs) <= 2  # a batch holds only what its slots can
            assert all(i.kind is not WorkKind.PAGE for i in batch.items[1:])  # paging comes first
        d = await tinker.describe_coordinator()
        assert (d["runs_live"], sum(w["slots_used"] for w in d["workers"].values())) == (7, 2)
        assert d["runs_paged"] == 5 and d["page_ins"] > 0 and d["page_ins"] <= d["page_outs"]
        assert len(engine.pages) == 5 and len(engine.slots) == 2

        # A run that ends while paged out drops its page; one that ends resident frees its slot.
        ended = sorted(m for m, (_, slot) in d["placements"].items() if slot < 0)[0]
        await tinker.client.get_workflow_handle(f"training-run/{ended}").signal(TrainingRunWorkflow.close, "done")
        await eventually(lambda: ended not in engine.pages)
        assert [i.slot for i in engine.of_kind("free_adapter")] == [-1]
        assert (await tinker.describe_coordinator())["runs_live"] == 6


async def test_one_tenant_churning_many_runs_does_not_delay_another_tenants_op(tinker_factory) -> None:
    """Tenant A keeps 10 runs busy on a worker with 2 slots, so every one of its ops needs a page-in; tenant B's one
    op, queued after all of A's, is in the very next batch (fair order over sessions, then slots in that order)."""
    engine = SlotEngine()
    async with tinker_factory(max_adapters=2, max_paged=100, engine=engine) as tinker:
        a, _ = await tinker.start_session()
        b, _ = await tinker.start_session()
        a_runs = [(await tinker.ready_run(a, n))[1] for n in range(10)]
        _, b_run = await tinker.ready_run(b, 0)
        held = await tinker.submit(a_runs[0], tinker.fwd(1, hold=True))  # the worker is busy: the rest queues
        await engine.wait_for(lambda: any("hold" in fwd_flags(i) for i in engine.items))
        busy = len(engine.batches)
        a_ops = [await tinker.submit(run, tinker.fwd(1)) for run in a_runs[1:]]
        await eventually(lambda: _pending_is(tinker, 9))
        b_op = await tinker.submit(b_run, tinker.fwd(1))
        await eventually(lambda: _pending_is(tinker, 10))

        engine.release.set()
        assert (await within(held.result())).ok
        assert (await within(b_op.result())).ok
        next_batch = engine.batches[busy]
        assert b_run.id.removeprefix("training-run/") in {i.model_id for i in next_batch.items}
        assert all(o.ok for o in await within(asyncio.gather(*(h.result() for h in a_ops)), timeout=60))
        assert engine.wrong == []


async def _pending_is(tinker: Tinker, n: int) -> bool:
    return (await tinker.describe_coordinator())["pending"] == n


async def test_creates_are_refused_only_past_the_owners_limit_or_the_workers_capacity(tinker_factory) -> None:
    engine = SlotEngine()
    async with tinker_factory(max_adapters=2, max_paged=2, engine=engine) as tinker:
        sid, _ = await tinker.start_session()
        limited = {"owner": "tenant-a", "max_live_runs": 2}
        a0, _ = await tinker.ready_run(sid, 0, **limited)
        await tinker.ready_run(sid, 1, **limited)
        run, refused = await tinker.create_run(sid, 2, **limited)
        assert not refused.ok and refused.category == "user"
        assert "already holds 2 live training runs" in refused.error and "--max-live-runs-per-tenant" in refused.error
        state: RunState = await within(run.result())
        assert state.status == "closed"  # a refused create ends its run, as before

        await tinker.ready_run(sid, 3, owner="tenant-b", max_live_runs=2)  # another tenant is not affected
        await tinker.ready_run(sid, 4, owner="tenant-b", max_live_runs=2)
        _, full = await tinker.create_run(sid, 5, owner="tenant-c", max_live_runs=2)  # 2 slots + 2 paged: full
        assert not full.ok and "no room for another LoRA adapter" in full.error
        assert "--adapter-host-memory-mb" in full.error

        await tinker.client.get_workflow_handle(f"training-run/{a0}").signal(TrainingRunWorkflow.close, "done")
        await eventually(lambda: _live_is(tinker, 3))
        _, again = await tinker.create_run(sid, 6, **limited)  # a run ended: room for tenant A again
        assert again.ok, again


async def _live_is(tinker: Tinker, n: int) -> bool:
    return (await tinker.describe_coordinator())["runs_live"] == n


async def test_a_page_in_the_worker_fails_restores_that_run_and_its_op_succeeds(tinker_factory) -> None:
    engine = SlotEngine()
    async with tinker_factory(max_adapters=1, max_paged=10, engine=engine) as tinker:
        sid, _ = await tinker.start_session()
        first, run_a = await tinker.ready_run(sid, 0, snapshot_every=5)
        _, run_b = await tinker.ready_run(sid, 1, snapshot_every=5)  # pages `first` out
        assert first in engine.pages
        engine.fail_page_in.add(first)
        out = await tinker.op(run_a, tinker.fwd(1))
        assert out.ok, out  # answered worker-lost, restored (a fresh adapter: no snapshot yet), retried
        state: RunState = await run_a.query(TrainingRunWorkflow.describe)
        assert state.recoveries == 1
        assert (await tinker.op(run_b, tinker.fwd(1))).ok
        assert engine.wrong == []


def test_the_paging_patch_id_is_the_one_the_coordinator_checks() -> None:
    assert PATCH_PAGING == "coordinator-adapter-paging-v1"
