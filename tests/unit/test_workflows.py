"""The four workflows end to end on a local Temporal dev server, with the JAX worker's `run_batch` mocked by name.

What is under test is the real workflow code: seq_id ordering and retries on TrainingRun, batching and slot
allocation in the Coordinator, heartbeats and clean-up in Session, and SampleRequest's round trip.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from wf_harness import (
    MockEngine,
    Tinker,
    TrainingOp,
    blob,
    body_hash,
    eventually,
    fwd_flags,
    fwd_seq,
    jax_worker,
    local_temporal,
    new_queue,
    tinker_world,
    unique_queue,
    within,
    workflow_worker,
)

from tinkerflow.workflows import names
from tinkerflow.workflows.messages import (
    AdamSpec,
    Batch,
    BatchResult,
    LoadCheckpoint,
    RunState,
    SampleParams,
    SamplerInfo,
    SampleStart,
    SaveRequest,
    SessionState,
)
from tinkerflow.workflows.sample_request import SampleRequestWorkflow
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
        await eventually(lambda: _session_has_runs(session, [a_id]))

        await session.signal(SessionWorkflow.finish, "user is done")
        ended: SessionState = await within(session.result())
        assert (ended.status, ended.reason) == ("finished", "user is done")
        assert (await within(run_a.result())).status == "closed"

        other_sid, _ = await tinker.start_session()
        _, outcome = await tinker.create_run(other_sid, 1)
        assert outcome.ok, outcome


async def _session_has_runs(session, model_ids: list[str]) -> bool:
    state: SessionState = await session.query(SessionWorkflow.describe)
    return state.training_run_ids == model_ids


# --- 6. sessions ------------------------------------------------------------------------------------------------------


async def test_session_without_heartbeats_times_out_and_closes_its_runs(tinker: Tinker) -> None:
    t0 = time.monotonic()
    sid, session = await tinker.start_session(heartbeat_timeout_s=2)
    (a_id, run_a), (b_id, run_b) = [await tinker.ready_run(sid, n) for n in (1, 2)]
    assert (await tinker.op(run_a, tinker.fwd(1))).ok
    await eventually(lambda: _session_has_runs(session, [a_id, b_id]), timeout=1.5)

    ended: SessionState = await within(session.result(), 10)
    assert ended.status == "timed_out" and "no heartbeat for 2s" in ended.reason
    assert time.monotonic() - t0 >= 2
    for run in (run_a, run_b):
        state: RunState = await within(run.result(), 10)
        assert state.status == "closed" and "session timed_out" in state.error
    await tinker.engine.wait_for(lambda: {i.model_id for i in tinker.engine.of_kind("free_adapter")} == {a_id, b_id})
    assert await eventually(lambda: _placements_are(tinker, {}))


async def _placements_are(tinker: Tinker, expected: dict) -> bool:
    return (await tinker.describe_coordinator())["placements"] == expected


async def test_heartbeats_keep_a_session_open_and_finish_ends_it(tinker: Tinker) -> None:
    sid, session = await tinker.start_session(heartbeat_timeout_s=2)
    a_id, run_a = await tinker.ready_run(sid, 1)
    for _ in range(8):  # 4 s of heartbeats, twice the timeout
        await session.signal(SessionWorkflow.heartbeat)
        await asyncio.sleep(0.5)
    state: SessionState = await session.query(SessionWorkflow.describe)
    assert state.status == "active" and state.heartbeats == 8
    status = (await session.describe()).status
    assert status is not None and status.name == "RUNNING"
    assert (await tinker.op(run_a, tinker.fwd(1))).ok  # its run is still alive

    await session.signal(SessionWorkflow.finish, "")
    ended: SessionState = await within(session.result())
    assert (ended.status, ended.reason) == ("finished", "finished")
    assert (await within(run_a.result())).status == "closed"
    await tinker.engine.wait_for(lambda: [i.model_id for i in tinker.engine.of_kind("free_adapter")] == [a_id])


# --- 7. sampling ------------------------------------------------------------------------------------------------------


async def test_sample_request_returns_the_engine_outcome(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    sampler = SamplerInfo(sampler_id=names.sampler_id_for(sid, 1), base_model=tinker.base_model)
    handle = await tinker.client.start_workflow(
        SampleRequestWorkflow.run,
        SampleStart(sampler=sampler, payloads=[blob("mem://sample-request/1")]),
        id=names.sample_workflow_id(sampler.sampler_id, body_hash("sample", 1)),
        task_queue=tinker.workflow_queue,
    )
    tinker.started.append(handle)
    [outcome] = await within(handle.result())

    [item] = tinker.engine.of_kind("sample")
    assert outcome == tinker.engine.answer(item)
    assert outcome.ok and outcome.json["sequences"] == [[1, 2, 3]]
    assert item.requester == handle.id and item.session_id == sid
    assert item.payload == blob("mem://sample-request/1")
    assert item.snapshot == "" and item.sample == SampleParams(sampler_id=sampler.sampler_id)

    bad = SamplerInfo(sampler_id=names.sampler_id_for(sid, 2), base_model=tinker.base_model)
    [refused] = await within(
        tinker.client.execute_workflow(
            SampleRequestWorkflow.run,
            SampleStart(sampler=bad, payloads=[blob("bad:request")]),
            id=names.sample_workflow_id(bad.sampler_id, body_hash("sample", 2)),
            task_queue=tinker.workflow_queue,
        )
    )
    assert not refused.ok and "mock engine refused sample" in refused.error


async def test_sample_from_saved_weights_loads_them_first_in_the_same_batch(tinker: Tinker) -> None:
    """Saved sampler weights no worker holds in memory are loaded (load_snapshot) right before the sample, on the
    same worker and in the same batch; the next sample of them finds them there and loads nothing."""
    sid, _ = await tinker.start_session()
    path = "tinker://elsewhere:train:0/sampler_weights/x"
    sampler = SamplerInfo(sampler_id=names.sampler_id_for(sid, 1), base_model=tinker.base_model, snapshot=path)
    for n in range(2):
        [outcome] = await within(
            tinker.client.execute_workflow(
                SampleRequestWorkflow.run,
                SampleStart(sampler=sampler, payloads=[blob(f"mem://r{n}")]),
                id=names.sample_workflow_id(sampler.sampler_id, body_hash("s", n)),
                task_queue=tinker.workflow_queue,
            )
        )
        assert outcome.ok
    [load] = tinker.engine.of_kind("load_snapshot")
    assert load.load == LoadCheckpoint(path=path)
    first = next(b for b in tinker.engine.batches if any(i.kind == "sample" for i in b.items))
    assert [i.kind for i in first.items] == ["load_snapshot", "sample"]
    assert len(tinker.engine.of_kind("sample")) == 2


async def test_a_finished_sessions_snapshots_are_dropped_on_every_worker_holding_them(temporal_env, tinker) -> None:
    """Runs of one session on two workers each made a sampler snapshot; finishing the session drops both, each on
    its own worker (before the patch only the first holder heard of it, and the other kept its copy)."""
    second = new_queue()
    async with jax_worker(temporal_env.client, tinker.engine, second):
        await tinker.register(second)
        sid, session = await tinker.start_session()
        samplers = []
        for n in (1, 2):
            _model_id, run = await tinker.ready_run(sid, n)
            saved = await tinker.op(
                run,
                TrainingOp(
                    seq_id=1,
                    kind="save_weights_for_sampler",
                    body_hash=body_hash(n),
                    save=SaveRequest(sampling_session_seq_id=n),
                ),
            )
            assert saved.ok, saved
            samplers.append(names.sampler_id_for(sid, n))
        placements = (await tinker.describe_coordinator())["placements"]
        assert len({queue for queue, _ in placements.values()}) == 2  # one run per worker
        await session.signal(SessionWorkflow.finish, "bye")
        await within(session.result())
        await tinker.engine.wait_for(lambda: len(tinker.engine.of_kind("drop_snapshots")) == 2)
        drops = [i.drop for i in tinker.engine.of_kind("drop_snapshots")]
        assert sorted(k for d in drops for k in d.keys) == sorted(samplers)
        assert {d.queue for d in drops} == {queue for queue, _ in placements.values()}
        assert (await tinker.describe_coordinator())["snapshots"] == 0


async def test_save_weights_for_sampler_then_sample_from_them(tinker: Tinker) -> None:
    sid, session = await tinker.start_session()
    model_id, run = await tinker.ready_run(sid, 1)
    saved = await tinker.op(
        run,
        TrainingOp(
            seq_id=1,
            kind="save_weights_for_sampler",
            body_hash=body_hash("save"),
            save=SaveRequest(path=None, sampling_session_seq_id=7),
        ),
    )
    sampler_id = names.sampler_id_for(sid, 7)
    assert saved.json == {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}
    [snap] = tinker.engine.of_kind("snapshot")
    assert snap.model_id == model_id and snap.snapshot == sampler_id

    info: SamplerInfo = await within(session.execute_update(SessionWorkflow.resolve_sampler, sampler_id))
    assert (info.snapshot, info.source_model_id) == (sampler_id, model_id)
    [outcome] = await within(
        tinker.client.execute_workflow(
            SampleRequestWorkflow.run,
            SampleStart(sampler=info, payloads=[blob("mem://r")]),
            id=names.sample_workflow_id(sampler_id, body_hash("s")),
            task_queue=tinker.workflow_queue,
        )
    )
    assert outcome.ok and outcome.json["snapshot"] == sampler_id

    named = await tinker.op(
        run,
        TrainingOp(
            seq_id=2, kind="save_weights_for_sampler", body_hash=body_hash("named"), save=SaveRequest(path="ckpt-1")
        ),
    )
    assert named.json == {"path": f"tinker://{model_id}/sampler_weights/ckpt-1", "type": "save_weights_for_sampler"}
    # Named weights are also written to storage (PEFT files) by the worker holding the adapter.
    [save] = tinker.engine.of_kind("save_checkpoint")
    assert save.save is not None
    assert save.model_id == model_id and save.save.path == f"tinker://{model_id}/sampler_weights/ckpt-1"
    assert save.save.manifest["lora"]["rank"] == 8 and save.save.manifest["expires_at"] is None
    assert (await tinker.describe_coordinator())["snapshots"] == 2

    # Finishing the session drops its ephemeral sampler weights (the named checkpoint stays).
    await session.signal(SessionWorkflow.finish, "bye")
    await within(session.result())
    await tinker.engine.wait_for(lambda: len(tinker.engine.of_kind("drop_snapshots")) == 1)
    # The session names a prefix; the Coordinator resolves it into the keys its record holds, for their worker.
    dropped = tinker.engine.of_kind("drop_snapshots")[0].drop
    assert dropped is not None and dropped.prefix == f"{sid}:sample:" and dropped.keys == [sampler_id]
    assert await eventually(lambda: _snapshots_are(tinker, 1))


async def _snapshots_are(tinker: Tinker, n: int) -> bool:
    return (await tinker.describe_coordinator())["snapshots"] == n


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
