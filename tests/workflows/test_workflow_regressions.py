"""Regressions: workflow bugs found by these tests, each pinned by the behaviour docs/architecture.md §The workflows
describes.

- a reused seq_id with a different body, sent while the first is still in flight, is refused (it used to hang);
- closing a run completes even while an op waits for a seq_id that never comes (the slot used to leak);
- a pool of two workers keeps serving while one is busy (the coordinator used to spin into a deadlock error);
- a coordinator reaching its history limit during a batch keeps serving (same spin);
- resolving an unknown sampler fails that update, not the session's workflow task.

Every wait is bounded: a regression shows as "not answered within N s", never as a hung suite.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.worker import UnsandboxedWorkflowRunner
from wf_harness import Tinker, body_hash, local_temporal, tinker_world

import tinkerflow.workflows.session as session_module
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import RunState, SessionState
from tinkerflow.workflows.session import SessionWorkflow
from tinkerflow.workflows.training_run import TrainingRunWorkflow

pytestmark = pytest.mark.timeout(60)

WAIT = 5.0  # a healthy workflow answers any of these in well under a second
PROBE = Path(__file__).with_name("wf_probe.py")


async def outcome_within(awaitable, timeout: float = WAIT) -> tuple[bool, Any]:
    """(finished, result or exception) without cancelling into the Temporal client's own error types."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        return False, None
    exc = task.exception()
    return True, exc if exc is not None else task.result()


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


async def test_close_completes_and_frees_the_slot_while_an_op_waits_for_a_missing_seq(tinker: Tinker) -> None:
    sid, _session = await tinker.start_session()
    model_id, run = await tinker.ready_run(sid, 1)
    orphan = await tinker.submit(run, tinker.fwd(2))  # seq 1 never arrives
    await run.signal(TrainingRunWorkflow.close, "session finished")

    finished, state = await outcome_within(run.result())
    assert finished, "the run never completes after close"
    assert isinstance(state, RunState) and state.status == "closed"
    finished, outcome = await outcome_within(orphan.result())
    assert finished and (isinstance(outcome, Exception) or not outcome.ok)
    assert [i.model_id for i in tinker.engine.of_kind("free_adapter")] == [model_id]


async def run_probe(scenario: str, timeout: float = 50.0) -> tuple[dict | None, str]:
    """Run a wf_probe.py scenario in its own process group; (its RESULT dict or None, its stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(PROBE),
        scenario,
        cwd=str(PROBE.parent),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        os.killpg(proc.pid, signal.SIGKILL)  # the probe and the dev server it started
        await proc.wait()
        return None, "probe timed out"
    lines = [line for line in out.decode().splitlines() if line.startswith("RESULT ")]
    return (json.loads(lines[-1][len("RESULT ") :]) if lines else None), err.decode(errors="replace")


def deadlock_note(stderr: str) -> str:
    return " (the worker logged TMPRL1101 'Potential deadlock detected')" if "TMPRL1101" in stderr else ""


# The two coordinator bugs below make a workflow thread spin forever, which the SDK cannot stop and which keeps any
# worker that ran it from shutting down; so they run in a child process (wf_probe.py) with its own dev server.


async def test_a_pool_of_two_workers_keeps_serving_when_one_is_busy() -> None:
    result, stderr = await run_probe("two_workers")
    assert result is not None, f"probe failed: {stderr[-2000:]}"
    assert result == {"query_answered": True, "busy_op_answered": True, "queued_op_answered": True}, (
        f"the coordinator stopped serving: {result}{deadlock_note(stderr)}"
    )


async def test_coordinator_reaching_its_history_limit_during_a_batch_keeps_serving() -> None:
    result, stderr = await run_probe("continue_as_new_while_busy")
    assert result is not None, f"probe failed: {stderr[-2000:]}"
    assert result["history_length_while_busy"] > 60, result  # the scenario did reach the suggestion point
    assert result["busy_op_answered"] and result["samples_answered"], (
        f"the coordinator stopped serving: {result}{deadlock_note(stderr)}"
    )


async def test_resolving_an_unknown_sampler_fails_the_update_not_the_session(monkeypatch) -> None:
    # RESOLVE_TIMEOUT is 30 s; shorten it. The module global is only patchable outside the sandbox, so this test has
    # its own dev server whose workflow worker runs unsandboxed.
    monkeypatch.setattr(session_module, "RESOLVE_TIMEOUT", timedelta(seconds=1))
    async with local_temporal() as env, tinker_world(env.client, workflow_runner=UnsandboxedWorkflowRunner()) as tinker:
        sid, session = await tinker.start_session()
        finished, result = await outcome_within(
            session.execute_update(SessionWorkflow.resolve_sampler, names.sampler_id_for(sid, 9))
        )
        assert finished, "the update is never answered: the session's workflow task fails instead"
        assert isinstance(result, WorkflowUpdateFailedError)

        await session.signal(SessionWorkflow.heartbeat)
        finished, state = await outcome_within(session.query(SessionWorkflow.describe))
        assert finished and isinstance(state, SessionState) and state.status == "active"


async def test_old_ephemeral_snapshots_are_collected_once_idle(monkeypatch) -> None:
    """An RL loop makes one sampler snapshot per step; the coordinator must not keep them all on the worker."""
    import tinkerflow.workflows.coordinator.placement as placement_module
    from tinkerflow.workflows.protocol.messages import SaveRequest, TrainingOp

    monkeypatch.setattr(placement_module, "EPHEMERAL_SNAPSHOT_IDLE_S", 1.0)
    async with local_temporal() as env, tinker_world(env.client, workflow_runner=UnsandboxedWorkflowRunner()) as tinker:
        sid, _ = await tinker.start_session()
        _, run = await tinker.ready_run(sid, 1)

        async def save(seq: int) -> None:
            outcome = await tinker.op(
                run,
                TrainingOp(
                    seq_id=seq,
                    kind="save_weights_for_sampler",
                    body_hash=body_hash("save", seq),
                    save=SaveRequest(path=None, sampling_session_seq_id=seq),
                ),
            )
            assert outcome.ok, outcome.error

        await save(1)
        await save(2)  # snapshot 1 is not idle yet: both stay
        assert tinker.engine.of_kind("drop_snapshots") == []
        await asyncio.sleep(1.5)
        await save(3)  # now 1 and 2 are idle and older than 3
        await tinker.engine.wait_for(lambda: len(tinker.engine.of_kind("drop_snapshots")) == 1)
        drop = tinker.engine.of_kind("drop_snapshots")[0].drop
        assert drop is not None and drop.keys is not None
        dropped = drop.keys
        assert sorted(dropped) == [names.sampler_id_for(sid, 1), names.sampler_id_for(sid, 2)]
        assert (await tinker.describe_coordinator())["snapshots"] == 1
