"""Known bugs in the workflows, each pinned by a test of the behaviour DESIGN §2 asks for.

They are `xfail(strict=True)`: the suite stays green while the bug is there, and turns red (XPASS) the day it is
fixed, so the marker gets removed. Every wait is bounded: a bug here shows as "not answered within N s", never as a
hung suite.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

import tinkerflow.workflows.session as session_module
from tinkerflow.workflows import names
from tinkerflow.workflows.messages import RunState, SamplerInfo, SampleStart, SessionState
from tinkerflow.workflows.sample_request import SampleRequestWorkflow
from tinkerflow.workflows.session import SessionWorkflow
from tinkerflow.workflows.training_run import TrainingRunWorkflow
from wf_harness import (
    ALL_WORKFLOWS,
    Tinker,
    blob,
    body_hash,
    jax_worker,
    local_temporal,
    new_queue,
    tinker_world,
    workflow_worker,
)

pytestmark = pytest.mark.timeout(60)

WAIT = 5.0  # a healthy workflow answers any of these in well under a second


async def outcome_within(awaitable, timeout: float = WAIT) -> tuple[bool, Any]:
    """(finished, result or exception) without cancelling into the Temporal client's own error types."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        return False, None
    exc = task.exception()
    return True, exc if exc is not None else task.result()


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "training_run.py:101-108/82: a reused seq_id with a different body is only refused once the first one is "
    "answered; while it is in flight the validator accepts it and the handler then waits forever for next_seq"))
async def test_conflicting_seq_id_is_refused_even_while_the_first_is_in_flight(tinker: Tinker) -> None:
    sid, _ = await tinker.start_session()
    _, run = await tinker.ready_run(sid, 1)
    first = await tinker.submit(run, tinker.fwd(1, "original", hold=True))
    await tinker.engine.wait_for(lambda: len(tinker.engine.of_kind("forward_backward")) == 1)
    conflicting = await tinker.submit(run, tinker.fwd(1, "different"))  # accepted today
    tinker.engine.release.set()
    assert (await first.result()).ok

    finished, result = await outcome_within(conflicting.result())
    assert finished, "the conflicting update was accepted and is never answered"
    assert isinstance(result, WorkflowUpdateFailedError)
    assert isinstance(result.cause, ApplicationError) and result.cause.type == "SeqConflict"


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "training_run.py:82 waits only for its seq_id's turn and line 38 waits for all handlers: an op waiting for a "
    "seq_id that never comes (client died mid-flight) keeps a closed run (and its adapter slot) alive forever"))
async def test_close_completes_and_frees_the_slot_while_an_op_waits_for_a_missing_seq(tinker: Tinker) -> None:
    sid, session = await tinker.start_session()
    model_id, run = await tinker.ready_run(sid, 1)
    orphan = await tinker.submit(run, tinker.fwd(2))  # seq 1 never arrives
    await run.signal(TrainingRunWorkflow.close, "session finished")

    finished, state = await outcome_within(run.result())
    assert finished, "the run never completes after close"
    assert isinstance(state, RunState) and state.status == "closed"
    finished, outcome = await outcome_within(orphan.result())
    assert finished and (isinstance(outcome, Exception) or not outcome.ok)
    assert [i.model_id for i in tinker.engine.of_kind("free_adapter")] == [model_id]


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "coordinator.py:64/115-118: with two workers, work queued for the busy one while the other is idle makes "
    "_ready_queues() true while _take_for() takes nothing, so run() spins without yielding: the coordinator's "
    "workflow task fails with a TMPRL1101 deadlock on every attempt and nothing on the base model is served again"))
async def test_a_pool_of_two_workers_keeps_serving_when_one_is_busy(tinker: Tinker) -> None:
    second = new_queue()
    async with jax_worker(tinker.client, tinker.engine, second):
        await tinker.register(second)
        sid, _ = await tinker.start_session()
        runs = [await tinker.ready_run(sid, n) for n in (1, 2, 3)]
        placements = (await tinker.describe_coordinator())["placements"]
        (first_id, first_run), *others = runs
        same_worker = next(run for model_id, run in others if placements[model_id][0] == placements[first_id][0])

        busy = await tinker.submit(first_run, tinker.fwd(1, hold=True))
        await tinker.engine.wait_for(lambda: len(tinker.engine.of_kind("forward_backward")) == 1)
        queued = await tinker.submit(same_worker, tinker.fwd(1))  # waits for the busy worker
        await asyncio.sleep(1.0)  # the coordinator has seen `queued` (signals take ~10 ms)
        tinker.engine.release.set()

        finished, described = await outcome_within(tinker.describe_coordinator())
        assert finished and not isinstance(described, Exception), "the coordinator stopped answering queries"
        for update in (busy, queued):
            finished, outcome = await outcome_within(update.result())
            assert finished, "the coordinator deadlocked; ops on this base model are never answered"
            assert outcome.ok


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "coordinator.py:64/70: once continue-as-new is suggested while a batch is in flight, the wait_condition at "
    "line 64 is always true and line 70 skips continue-as-new while busy, so run() spins without yielding "
    "(TMPRL1101 deadlock) and the coordinator never serves again; under load it is busy nearly always"))
async def test_coordinator_reaching_its_history_limit_during_a_batch_keeps_serving() -> None:
    async with local_temporal("limit.historyCount.suggestContinueAsNew=60") as env:
        async with workflow_worker(env.client), tinker_world(env.client) as tinker:
            sid, _ = await tinker.start_session()
            _, run = await tinker.ready_run(sid, 1)
            busy = await tinker.submit(run, tinker.fwd(1, hold=True))
            await tinker.engine.wait_for(lambda: len(tinker.engine.of_kind("forward_backward")) == 1)
            # An RL client's burst of sample calls arrives while the engine is busy: ~4 history events each.
            sampler = SamplerInfo(sampler_id=names.sampler_id_for(sid, 1), base_model=tinker.base_model)
            samples = []
            for n in range(20):
                handle = await env.client.start_workflow(
                    SampleRequestWorkflow.run, SampleStart(sampler=sampler, payload=blob(f"mem://s/{n}")),
                    id=names.sample_workflow_id(sampler.sampler_id, n, body_hash("s", n)),
                    task_queue=names.WORKFLOW_TASK_QUEUE)
                tinker.started.append(handle)
                samples.append(handle)
            await asyncio.sleep(1.5)  # every submit has reached the coordinator while the batch is in flight
            tinker.engine.release.set()

            finished, outcome = await outcome_within(busy.result())
            assert finished, "the coordinator deadlocked at its continue-as-new point"
            assert outcome.ok
            finished, outcomes = await outcome_within(asyncio.gather(*(h.result() for h in samples)))
            assert finished and all(o.ok for o in outcomes)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "session.py:307 raises ValueError from an update handler after validation; that is not a Temporal failure "
    "error, so the SDK fails the session's workflow task (on every replay) instead of failing the update: one "
    "lookup of an unknown sampling session id wedges the whole session (heartbeats, queries, finish, clean-up)"))
async def test_resolving_an_unknown_sampler_fails_the_update_not_the_session(monkeypatch) -> None:
    # RESOLVE_TIMEOUT is 30 s; shorten it. The module global is only patchable outside the sandbox, so this test has
    # its own dev server whose workflow worker runs unsandboxed.
    monkeypatch.setattr(session_module, "RESOLVE_TIMEOUT", timedelta(seconds=1))
    async with local_temporal() as env:
        worker = Worker(env.client, task_queue=names.WORKFLOW_TASK_QUEUE, workflows=ALL_WORKFLOWS,
                        workflow_runner=UnsandboxedWorkflowRunner())
        async with worker, tinker_world(env.client) as tinker:
            sid, session = await tinker.start_session()
            finished, result = await outcome_within(
                session.execute_update(SessionWorkflow.resolve_sampler, names.sampler_id_for(sid, 9)))
            assert finished, "the update is never answered: the session's workflow task fails instead"
            assert isinstance(result, WorkflowUpdateFailedError)

            await session.signal(SessionWorkflow.heartbeat)
            finished, state = await outcome_within(session.query(SessionWorkflow.describe))
            assert finished and isinstance(state, SessionState) and state.status == "active"
