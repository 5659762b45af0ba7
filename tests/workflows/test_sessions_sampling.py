"""Sessions and sampling in the workflows on a local Temporal dev server, the JAX worker's `run_batch` mocked by
name: heartbeats and clean-up in Session, SampleRequest's round trip, snapshots and saved sampler weights.
(test_workflows.py holds TrainingRun's ordering, retries and conflicts, batching, slots, errors and continue-as-new.)
"""

from __future__ import annotations

import asyncio
import time

import pytest
from mock_engine import blob, jax_worker, new_queue
from wf_harness import Tinker, TrainingOp, body_hash, eventually, session_has_runs, within

from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import (
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

pytestmark = pytest.mark.timeout(60)


# --- 6. sessions ------------------------------------------------------------------------------------------------------


async def test_session_without_heartbeats_times_out_and_closes_its_runs(tinker: Tinker) -> None:
    t0 = time.monotonic()
    sid, session = await tinker.start_session(heartbeat_timeout_s=2)
    (a_id, run_a), (b_id, run_b) = [await tinker.ready_run(sid, n) for n in (1, 2)]
    assert (await tinker.op(run_a, tinker.fwd(1))).ok
    await eventually(lambda: session_has_runs(session, [a_id, b_id]), timeout=1.5)

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


async def test_sample_calls_lost_with_their_worker_are_sent_again_and_their_snapshot_loaded_on_the_successor(
    tinker: Tinker,
) -> None:
    """A batch of two sample calls on an ephemeral snapshot is lost with its worker (the mock refuses it as a
    restarted worker refuses its predecessor's batches); the worker comes back as a new process. Both calls are
    sent again, once, and the successor loads the snapshot by its key before sampling."""
    sid, session = await tinker.start_session()
    _model_id, run = await tinker.ready_run(sid, 1)
    save = SaveRequest(sampling_session_seq_id=3)
    saved = await tinker.op(run, TrainingOp(seq_id=1, kind="save_weights_for_sampler", body_hash="s", save=save))
    assert saved.ok, saved
    sampler_id = names.sampler_id_for(sid, 3)
    info: SamplerInfo = await within(session.execute_update(SessionWorkflow.resolve_sampler, sampler_id))
    payloads = [blob("mem://request/1/sample?lost"), blob("mem://r2")]
    handle = await tinker.client.start_workflow(
        SampleRequestWorkflow.run,
        SampleStart(sampler=info, payloads=payloads),
        id=names.sample_workflow_id(sampler_id, body_hash("lost")),
        task_queue=tinker.workflow_queue,
    )
    tinker.started.append(handle)
    await tinker.engine.wait_for(lambda: bool(tinker.engine.dead))
    await eventually(lambda: _snapshots_are(tinker, 0))  # the dead worker's snapshot went with it
    await tinker.register(tinker.queues[0])  # its successor

    outcomes = await within(handle.result())
    assert [o.ok for o in outcomes] == [True, True], outcomes
    [load] = tinker.engine.of_kind("load_snapshot")
    assert load.load == LoadCheckpoint(path=sampler_id)
    last = tinker.engine.ran[-1]
    assert [i.kind for i in last.items] == ["load_snapshot", "sample", "sample"]
    assert [i.payload for i in last.items[1:]] == payloads  # the same bodies: the same seeds
    assert len(tinker.engine.of_kind("sample")) == 4  # each call twice: lost once, then answered
