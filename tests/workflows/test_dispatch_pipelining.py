"""Pipelined dispatch (workflows/coordinator/dispatch.py) on the real workflows and a local Temporal server, with a
mocked JAX worker that holds two batches and runs them in the order they were dispatched (as activities/batch_order.py
does).

The next batch is queued while one runs, and runs after it; never more than two are in flight; a batch that is
lost takes the one queued behind it along, every run restoring itself; a worker that restarts fails both at once;
the queued batch never pages out a run whose op is in flight. A worker older than pipelining (pipeline_depth 0)
still gets one batch at a time (test_workflows.py: test_forward_backward_of_two_runs_share_one_batch_...)."""

from __future__ import annotations

import asyncio

import pytest
from mock_engine import MockEngine, fwd_seq
from temporalio.worker import Replayer
from test_paging import SlotEngine
from wf_harness import ALL_WORKFLOWS, Tinker, eventually, within

from tinkerflow.workflows.coordinator.dispatch import PIPELINE_DEPTH
from tinkerflow.workflows.coordinator.workflow import PATCH_PIPELINE
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import Batch, RunState
from tinkerflow.workflows.protocol.work import WorkKind
from tinkerflow.workflows.training_run import TrainingRunWorkflow

pytestmark = pytest.mark.timeout(90)


def fwd_batches(engine: MockEngine) -> list[Batch]:
    return [b for b in engine.batches if any(i.kind is WorkKind.FORWARD_BACKWARD for i in b.items)]


async def in_flight(tinker: Tinker) -> int:
    return (await tinker.describe_coordinator())["workers"][tinker.queues[0]]["batches_in_flight"]


async def pending(tinker: Tinker) -> int:
    return (await tinker.describe_coordinator())["pending"]


async def test_the_next_batch_is_queued_while_one_runs_and_runs_after_it(tinker_factory) -> None:
    async with tinker_factory(pipeline_depth=PIPELINE_DEPTH) as tinker:
        engine: MockEngine = tinker.engine
        sid, _ = await tinker.start_session()
        (_, run_a), (b_id, run_b), (c_id, run_c) = [await tinker.ready_run(sid, n) for n in (1, 2, 3)]

        held = await tinker.submit(run_a, tinker.fwd(1, hold=True))
        await engine.wait_for(lambda: len(fwd_batches(engine)) == 1)
        queued = await tinker.submit(run_b, tinker.fwd(1))
        # Dispatched while the first still runs: the worker holds it, to run right after the first.
        await engine.wait_for(lambda: len(fwd_batches(engine)) == 2)
        first, second = fwd_batches(engine)
        assert first.batch_id and second.after == first.batch_id
        assert [i.model_id for i in second.items] == [b_id]
        assert second not in engine.ran

        # The third waits in the Coordinator: two batches in flight is the depth.
        later = await tinker.submit(run_c, tinker.fwd(1))
        await eventually(lambda: pending(tinker))
        assert await in_flight(tinker) == PIPELINE_DEPTH and len(fwd_batches(engine)) == 2

        engine.release.set()
        outcomes = await within(asyncio.gather(held.result(), queued.result(), later.result()))
        assert all(o.ok for o in outcomes), outcomes
        third = fwd_batches(engine)[2]
        # It follows the newest batch the Coordinator still had in flight when it formed it: the second, or none.
        # Or the first: the worker runs the two back to back and completes both activities within a millisecond,
        # and Temporal records the completions in the order they reach it, so the Coordinator can read the second's
        # before the first's. Naming the first is then right too: both have run on the worker already.
        assert [i.model_id for i in third.items] == [c_id]
        assert third.after in ("", first.batch_id, second.batch_id)
        ran = [b.batch_id for b in engine.ran if b in (first, second, third)]
        assert ran == [first.batch_id, second.batch_id, third.batch_id]
        assert (await tinker.describe_coordinator())["dispatched_batches"] == len(engine.batches)

        # Behind its patch, and the history replays on the current code.
        history = await tinker.coordinator.fetch_history()
        markers = [
            str(e.marker_recorded_event_attributes)
            for e in history.events
            if e.HasField("marker_recorded_event_attributes")
        ]
        assert any(PATCH_PIPELINE in m for m in markers)
        await Replayer(workflows=ALL_WORKFLOWS).replay_workflow(history)


async def test_a_lost_batch_takes_the_batch_queued_behind_it_and_both_runs_restore(tinker_factory) -> None:
    """The first batch fails as a restarted worker refuses its predecessor's batch: the one queued behind it (which
    the worker would only run after it) is answered lost too, and each run restores itself once a worker is back."""
    async with tinker_factory(pipeline_depth=PIPELINE_DEPTH) as tinker:
        engine: MockEngine = tinker.engine
        sid, _ = await tinker.start_session()
        runs = [await tinker.create_run(sid, n, snapshot_every=10) for n in (1, 2)]
        assert all(o.ok for _, o in runs), runs
        (run_a, _), (run_b, _) = runs
        doomed = await tinker.submit(run_a, tinker.fwd(1, hold=True, lost=True))
        await engine.wait_for(lambda: len(fwd_batches(engine)) == 1)
        behind = await tinker.submit(run_b, tinker.fwd(1))
        await engine.wait_for(lambda: len(fwd_batches(engine)) == 2)
        engine.release.set()

        async def forgotten() -> bool:  # the worker is taken for lost, with both its batches
            return not (await tinker.describe_coordinator())["workers"]

        await eventually(forgotten)
        await tinker.register(tinker.queues[0], pipeline_depth=PIPELINE_DEPTH)

        async def restored(handle) -> bool:
            state: RunState = await handle.query(TrainingRunWorkflow.describe)
            return state.recoveries >= 1

        for handle in (run_a, run_b):
            await eventually(lambda h=handle: restored(h))
        outcomes = await within(asyncio.gather(doomed.result(), behind.result()))
        assert all(o.ok for o in outcomes), outcomes  # each ran again on the worker that came back
        for n in (1, 2):
            model_id = names.model_id_for(sid, n)
            assert [fwd_seq(i) for i in engine.of_kind("forward_backward") if i.model_id == model_id] == [1, 1]


async def test_a_worker_that_restarts_fails_both_batches_in_flight_at_once(tinker_factory) -> None:
    async with tinker_factory(pipeline_depth=PIPELINE_DEPTH) as tinker:
        engine: MockEngine = tinker.engine
        sid, _ = await tinker.start_session()
        runs = [await tinker.create_run(sid, n, snapshot_every=10) for n in (1, 2)]
        (run_a, _), (run_b, _) = runs
        held = await tinker.submit(run_a, tinker.fwd(1, hold=True))
        await engine.wait_for(lambda: len(fwd_batches(engine)) == 1)
        queued = await tinker.submit(run_b, tinker.fwd(1))
        await engine.wait_for(lambda: len(fwd_batches(engine)) == 2)
        await tinker.register(tinker.queues[0], pipeline_depth=PIPELINE_DEPTH)  # a new process: both died with it

        async def restoring(handle) -> bool:
            state: RunState = await handle.query(TrainingRunWorkflow.describe)
            return state.recoveries == 1

        for handle in (run_a, run_b):  # well inside the heartbeat timeout: the mock never heartbeats
            await eventually(lambda h=handle: restoring(h), timeout=10)
        engine.release.set()  # the dead batches' late answers are dropped
        outcomes = await within(asyncio.gather(held.result(), queued.result()))
        assert all(o.ok for o in outcomes), outcomes
        assert len(engine.of_kind("create_adapter")) == 4  # each run's first, and its restore


async def test_the_queued_batch_never_pages_out_a_run_in_flight(tinker_factory) -> None:
    """One slot: while run A's op runs, run B's op needs A's slot. It waits for the next batch instead of queuing
    a batch that pages A out from under an op in flight; then it pages A out and trains on its own adapter."""
    engine = SlotEngine()
    async with tinker_factory(max_adapters=1, max_paged=10, engine=engine, pipeline_depth=PIPELINE_DEPTH) as tinker:
        sid, _ = await tinker.start_session()
        (a_id, run_a), (b_id, run_b) = [await tinker.ready_run(sid, n) for n in (1, 2)]
        assert (await tinker.op(run_a, tinker.fwd(1))).ok  # A resident, B paged out
        held = await tinker.submit(run_a, tinker.fwd(2, hold=True))
        await engine.wait_for(lambda: len(fwd_batches(engine)) == 2)
        waiting = await tinker.submit(run_b, tinker.fwd(1))
        await eventually(lambda: pending(tinker))
        assert await in_flight(tinker) == 1  # nothing formed behind the running batch: its one slot is A's
        engine.release.set()
        outcomes = await within(asyncio.gather(held.result(), waiting.result()))
        assert all(o.ok for o in outcomes), outcomes
        assert engine.wrong == []
        last = fwd_batches(engine)[-1]
        assert last.items[0].kind is WorkKind.PAGE and last.items[0].page is not None
        assert [m.model_id for m in last.items[0].page.page_out] == [a_id]
        assert [m.model_id for m in last.items[0].page.page_in] == [b_id]
