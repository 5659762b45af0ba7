"""The workflows on a local Temporal dev server, with the JAX worker's `run_batch` mocked by name.

What is under test is the real workflow code: seq_id ordering, retries and conflicts on TrainingRun, batching and slot
allocation in the Coordinator, errors and continue-as-new. Sessions and sampling: test_sessions_sampling.py.
"""

from __future__ import annotations

import asyncio

import pytest
from mock_engine import MockEngine, fwd_flags, fwd_seq, jax_worker, new_queue
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.worker import Replayer
from wf_harness import (
    ALL_WORKFLOWS,
    Tinker,
    TrainingOp,
    body_hash,
    eventually,
    local_temporal,
    session_has_runs,
    tinker_world,
    unique_queue,
    within,
    workflow_worker,
)

from tinkerflow.workflows.coordinator.workflow import PATCH_FAIL_RESTARTED_BATCH
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import (
    AdamSpec,
    Batch,
    BatchResult,
    RunState,
    SessionState,
)
from tinkerflow.workflows.session import SessionWorkflow
from tinkerflow.workflows.training_run import TrainingRunWorkflow

pytestmark = pytest.mark.timeout(60)


def fwd_seqs(engine: MockEngine, model_id: str | None = None) -> list[int]:
    return [fwd_seq(i) for i in engine.of_kind("forward_backward") if model_id in (None, i.model_id)]


def assert_seq_conflict(err: WorkflowUpdateFailedError) -> None:
    assert isinstance(err.cause, ApplicationError), err.cause
    assert err.cause.type == "SeqConflict", err.cause


# --- 1. ordering ------------------------------------------------------------------------------------------------------


async def test_ops_submitted_out_of_order_run_in_seq_order(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    model_id, run = await tinker.ready_run(sid, 1)

    # The SDK sends chunks concurrently, first chunk last: 3, 2, 1 each accepted before the next is sent.
    handles = [await tinker.submit(run, tinker.fwd(seq)) for seq in (3, 2, 1)]
    outcomes = await within(asyncio.gather(*(h.result() for h in handles)))

    assert all(o.ok for o in outcomes), outcomes
    assert fwd_seqs(tinker.engine, model_id) == [1, 2, 3]
    # Strictly one at a time: each fwd/bwd went to the engine in its own batch.
    assert [
        len([i for i in b.items if i.kind == "forward_backward"])
        for b in tinker.engine.batches
        if any(i.kind == "forward_backward" for i in b.items)
    ] == [1, 1, 1]
    # The proto result (blob) is what the future answers; the JSON summary only fed the run's state.
    assert all(o.blob is not None and o.json is None for o in outcomes)
    state: RunState = await run.query(TrainingRunWorkflow.describe)
    assert (state.next_seq, state.fwdbwd_count, state.tokens_seen, state.last_loss) == (4, 3, 9, 1.0)

    optim = await tinker.op(
        run, TrainingOp(seq_id=4, kind="optim_step", body_hash=body_hash("optim", 4), adam=AdamSpec(learning_rate=1e-4))
    )
    assert optim.ok and optim.json == {"metrics": {"slot": 0}}
    state = await run.query(TrainingRunWorkflow.describe)
    assert (state.step, state.status) == (1, "ready")
    assert [i.kind for i in tinker.engine.items if i.model_id == model_id] == [
        "create_adapter",
        "forward_backward",
        "forward_backward",
        "forward_backward",
        "optim_step",
    ]


# --- 2. retries -------------------------------------------------------------------------------------------------------


async def test_retried_op_executes_once_and_returns_the_first_answer(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    model_id, run = await tinker.ready_run(sid, 1)
    op = tinker.fwd(1, hold=True)  # the engine holds it, so the retry arrives while the first is in flight

    first = await tinker.submit(run, op)
    await tinker.engine.wait_for(lambda: len(fwd_seqs(tinker.engine)) == 1)
    retry = await tinker.submit(run, op)  # same seq_id, body_hash and update id: what a retried HTTP call sends
    tinker.engine.release.set()
    a, b = await within(asyncio.gather(first.result(), retry.result()))
    assert a.ok and a == b
    assert a.blob is not None and a.blob.uri.startswith("mem://fwd/")

    # A retry after the op finished: Temporal's update-id dedupe answers it.
    assert await tinker.op(run, op) == a
    # Same seq_id and body under another update id (e.g. a request id minted after continue-as-new): the run's own
    # `answered` map answers it.
    late = await tinker.submit(run, op, update_id="seq-1-after-continue-as-new")
    assert await within(late.result()) == a

    assert fwd_seqs(tinker.engine, model_id) == [1]
    state: RunState = await run.query(TrainingRunWorkflow.describe)
    assert (state.fwdbwd_count, state.tokens_seen, state.next_seq) == (1, 3, 2)


# --- 3. conflicts -----------------------------------------------------------------------------------------------------


async def test_reused_seq_id_with_a_different_body_is_rejected(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    model_id, run = await tinker.ready_run(sid, 1)
    first = await tinker.op(run, tinker.fwd(1, "original"))
    assert first.ok

    conflicting = tinker.fwd(1, "different")
    assert conflicting.body_hash != tinker.fwd(1, "original").body_hash
    with pytest.raises(WorkflowUpdateFailedError) as err:
        await within((await tinker.submit(run, conflicting)).result())
    assert_seq_conflict(err.value)
    assert "already used for a different request" in str(err.value.cause)

    # A seq_id below next_seq that the run has no answer for is refused the same way.
    with pytest.raises(WorkflowUpdateFailedError) as err:
        await within((await tinker.submit(run, tinker.fwd(0))).result())
    assert_seq_conflict(err.value)

    # Rejections never ran anything and never disturbed the run.
    assert fwd_seqs(tinker.engine, model_id) == [1]
    assert (await tinker.op(run, tinker.fwd(2))).ok
    assert fwd_seqs(tinker.engine, model_id) == [1, 2]


# --- 4. batching ------------------------------------------------------------------------------------------------------


async def test_forward_backward_of_two_runs_share_one_batch_while_the_engine_is_busy(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    (_a_id, run_a), (b_id, run_b), (c_id, run_c) = [await tinker.ready_run(sid, n) for n in (1, 2, 3)]
    engine = tinker.engine

    slow = await tinker.submit(run_a, tinker.fwd(1, hold=True))
    await engine.wait_for(lambda: len(fwd_seqs(engine)) == 1)
    busy_batches = len(engine.batches)
    meanwhile = [await tinker.submit(run_b, tinker.fwd(1)), await tinker.submit(run_c, tinker.fwd(1))]
    # Both are queued in the coordinator (not yet dispatched: the worker's only slot is busy).
    await eventually(lambda: _pending_is(tinker, 2))
    assert len(engine.batches) == busy_batches

    engine.release.set()
    outcomes = await within(asyncio.gather(slow.result(), *(h.result() for h in meanwhile)))
    assert all(o.ok for o in outcomes), outcomes

    assert len(engine.batches) == busy_batches + 1
    batch = engine.batches[-1]
    assert [i.kind for i in batch.items] == ["forward_backward", "forward_backward"]
    assert {i.model_id for i in batch.items} == {b_id, c_id}
    # Each item carries its own run's adapter slot, and each run got its own share of the result.
    placements = (await tinker.describe_coordinator())["placements"]
    assert {i.model_id: i.slot for i in batch.items} == {b_id: placements[b_id][1], c_id: placements[c_id][1]}
    assert outcomes[1].blob != outcomes[2].blob
    assert (await tinker.describe_coordinator())["dispatched_batches"] == len(engine.batches)


async def _pending_is(tinker: Tinker, n: int) -> bool:
    return (await tinker.describe_coordinator())["pending"] == n


# --- 5. slot allocation -----------------------------------------------------------------------------------------------


async def test_slots_run_out_with_a_clear_error_and_close_frees_one(tinker_factory) -> None:
    async with tinker_factory(max_adapters=2) as tinker:
        sid, _ = await tinker.start_session()
        a_id, run_a = await tinker.ready_run(sid, 1)
        b_id, _run_b = await tinker.ready_run(sid, 2)
        slots = {i.model_id: i.slot for i in tinker.engine.of_kind("create_adapter")}
        assert sorted(slots.values()) == [0, 1]

        run_c, outcome = await tinker.create_run(sid, 3)  # answered, not left hanging
        assert not outcome.ok
        assert "no free LoRA adapter slot" in outcome.error and outcome.category == "user"
        state_c: RunState = await within(run_c.result())  # a run whose create failed ends itself
        assert state_c.status == "closed" and "no free LoRA adapter slot" in state_c.error
        assert len(tinker.engine.of_kind("create_adapter")) == 2  # the refused one never reached the engine

        await run_a.signal(TrainingRunWorkflow.close, "done with it")
        closed: RunState = await within(run_a.result())
        assert (closed.status, closed.error) == ("closed", "done with it")
        assert [i.model_id for i in tinker.engine.of_kind("free_adapter")] == [a_id]
        assert tinker.engine.of_kind("free_adapter")[0].slot == slots[a_id]

        d_id, _run_d = await tinker.ready_run(sid, 4)
        assert [i.slot for i in tinker.engine.of_kind("create_adapter") if i.model_id == d_id] == [slots[a_id]]
        described = await tinker.describe_coordinator()
        assert set(described["placements"]) == {b_id, d_id}
        assert [w["slots_used"] for w in described["workers"].values()] == [2]
        # The closed run refuses further ops.
        with pytest.raises(RPCError, match="already completed"):
            await tinker.submit(run_a, tinker.fwd(1))


async def test_finishing_a_session_frees_its_runs_slots(tinker_factory) -> None:
    async with tinker_factory(max_adapters=1) as tinker:
        sid, session = await tinker.start_session()
        a_id, run_a = await tinker.ready_run(sid, 1)
        await eventually(lambda: session_has_runs(session, [a_id]))

        await session.signal(SessionWorkflow.finish, "user is done")
        ended: SessionState = await within(session.result())
        assert (ended.status, ended.reason) == ("finished", "user is done")
        assert (await within(run_a.result())).status == "closed"

        other_sid, _ = await tinker.start_session()
        _, outcome = await tinker.create_run(other_sid, 1)
        assert outcome.ok, outcome


# --- 8. errors --------------------------------------------------------------------------------------------------------


async def test_reject_op_fails_its_own_future_and_the_next_seq_still_runs(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    model_id, run = await tinker.ready_run(sid, 1)
    # Sent out of order: seq 2 waits for the rejected seq 1 to be answered.
    second = await tinker.submit(run, tinker.fwd(2))
    rejected = await tinker.op(
        run, TrainingOp(seq_id=1, kind="reject", body_hash=body_hash("reject"), error="save_weights is not supported")
    )
    assert not rejected.ok and rejected.error == "save_weights is not supported" and rejected.category == "user"
    assert (await within(second.result())).ok
    assert fwd_seqs(tinker.engine, model_id) == [2]

    unknown = await tinker.op(run, TrainingOp(seq_id=3, kind="frobnicate", body_hash=body_hash("lw")))
    assert not unknown.ok and "unsupported training op" in unknown.error
    refused = await tinker.op(run, tinker.fwd(4, bad=True))  # the engine refuses this one
    assert not refused.ok and "mock engine refused forward_backward" in refused.error
    assert (await tinker.op(run, tinker.fwd(5))).ok

    state: RunState = await run.query(TrainingRunWorkflow.describe)
    assert state.next_seq == 6 and state.fwdbwd_count == 2 and state.status == "ready"
    assert not state.answered["1"].outcome.ok and state.answered["5"].outcome.ok


async def test_a_failing_engine_batch_becomes_a_server_error(temporal_env) -> None:
    engine = MockEngine()
    original = engine.run_batch

    async def exploding(batch: Batch) -> BatchResult:
        if any("explode" in fwd_flags(i) for i in batch.items):
            await original(batch)  # recorded
            raise ApplicationError("engine fell over", type="InputError", non_retryable=True)
        return await original(batch)

    engine.run_batch = exploding  # type: ignore[method-assign]
    tinker = Tinker(
        client=temporal_env.client,
        engine=engine,
        base_model=f"mock-model-explode-{id(engine)}",
        workflow_queue=unique_queue(),
    )
    queue = new_queue()
    async with (
        workflow_worker(temporal_env.client, tinker.workflow_queue),
        jax_worker(temporal_env.client, engine, queue),
    ):
        await tinker.register(queue)
        try:
            sid, _ = await tinker.start_session()
            model_id, run = await tinker.ready_run(sid, 1)
            failed = await tinker.op(run, tinker.fwd(1, explode=True))
            assert not failed.ok and failed.category == "server"
            assert "the JAX worker failed this batch" in failed.error and "engine fell over" in failed.error
            assert (await tinker.op(run, tinker.fwd(2))).ok
            assert fwd_seqs(engine, model_id) == [1, 2]  # non-retryable: tried once
        finally:
            await tinker.cleanup()


async def test_a_restarted_worker_lost_its_adapters(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    _model_id, run = await tinker.ready_run(sid, 1)
    await tinker.register(tinker.queues[0])  # the same worker registers again: its memory is gone

    outcome = await tinker.op(run, tinker.fwd(1))
    assert not outcome.ok and "has no adapter on any worker" in outcome.error
    assert fwd_seqs(tinker.engine) == []
    await run.signal(TrainingRunWorkflow.close, "")
    assert (await within(run.result())).status == "closed"  # closing still completes (nothing left to free)
    assert tinker.engine.of_kind("free_adapter") == []


async def test_a_batch_in_flight_on_a_worker_that_restarts_is_failed_at_once_and_the_run_restores(
    tinker: Tinker,
) -> None:
    """The new process's registration fails its predecessor's batch at once, not at the 15 s heartbeat timeout."""
    sid, _ = await tinker.start_session()
    handle, outcome = await tinker.create_run(sid, 1, snapshot_every=10)
    assert outcome.ok, outcome
    model_id = names.model_id_for(sid, 1)
    held = await tinker.submit(handle, tinker.fwd(1, hold=True))
    await tinker.engine.wait_for(lambda: len(fwd_seqs(tinker.engine, model_id)) == 1)
    await tinker.register(tinker.queues[0])  # the worker came back as a new process; the held batch died with it

    # The run starts restoring itself well inside the heartbeat timeout (the mocked activity never heartbeats).
    async def restoring() -> bool:
        state: RunState = await handle.query(TrainingRunWorkflow.describe)
        return state.recoveries == 1

    await eventually(restoring, timeout=10)
    # The mock's one activity slot is still held by the dead batch (a real dead process holds nothing): let it go.
    # Its late answer is dropped; the op runs again on the new process, after a fresh adapter (no snapshot yet).
    tinker.engine.release.set()
    answer = await within(held.result())
    assert answer.ok, answer
    assert len(tinker.engine.of_kind("create_adapter")) == 2
    assert fwd_seqs(tinker.engine, model_id) == [1, 1]
    # The new path is behind its patch (a marker in history) and replays deterministically from that history.
    history = await tinker.coordinator.fetch_history()
    markers = [e for e in history.events if e.HasField("marker_recorded_event_attributes")]
    assert any(PATCH_FAIL_RESTARTED_BATCH in str(m.marker_recorded_event_attributes) for m in markers)
    await Replayer(workflows=ALL_WORKFLOWS).replay_workflow(history)
    state: RunState = await handle.query(TrainingRunWorkflow.describe)
    assert state.recoveries == 1 and state.fwdbwd_count == 1


# --- 9. continue-as-new -----------------------------------------------------------------------------------------------


async def test_continue_as_new_keeps_coordinator_and_run_state() -> None:
    """A separate dev server whose history limit suggests continue-as-new after 60 events."""
    async with local_temporal("limit.historyCount.suggestContinueAsNew=60") as env, tinker_world(env.client) as tinker:
        sid, session = await tinker.start_session()
        model_id, run = await tinker.ready_run(sid, 1)
        coordinator_runs, training_runs = set(), set()
        first = None
        for seq in range(1, 13):
            op = (
                tinker.fwd(seq) if seq % 2 else TrainingOp(seq_id=seq, kind="optim_step", body_hash=body_hash("o", seq))
            )
            outcome = await tinker.op(run, op)
            assert outcome.ok, outcome
            first = first or outcome
            coordinator_runs.add((await tinker.coordinator.describe()).run_id)
            training_runs.add((await run.describe()).run_id)
        assert len(coordinator_runs) > 1 and len(training_runs) > 1, "continue-as-new never happened"

        state: RunState = await run.query(TrainingRunWorkflow.describe)
        assert (state.next_seq, state.fwdbwd_count, state.step, state.tokens_seen) == (13, 6, 6, 18)
        described = await tinker.describe_coordinator()
        assert described["placements"] == {model_id: [tinker.queues[0], 0]}
        assert described["dispatched_batches"] == len(tinker.engine.batches)
        # seq 1 was answered several runs ago; a retry still gets the first answer and runs nothing.
        retried = await tinker.submit(run, tinker.fwd(1))
        assert await within(retried.result()) == first
        assert fwd_seqs(tinker.engine) == [1, 3, 5, 7, 9, 11]
        # The session keeps its registry across its own continue-as-new (heartbeats fill its history here).
        session_run = (await session.describe()).run_id
        for _ in range(30):
            await session.signal(SessionWorkflow.heartbeat)
        await eventually(lambda: _run_id_changed(session, session_run))
        carried: SessionState = await session.query(SessionWorkflow.describe)
        assert carried.training_run_ids == [model_id] and carried.status == "active"
        assert carried.heartbeats == 30


async def _run_id_changed(handle, run_id: str) -> bool:
    return (await handle.describe()).run_id != run_id
