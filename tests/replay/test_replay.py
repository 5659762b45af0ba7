"""Replay the recorded histories of real runs (tests/replay/histories, written by `python -m tests.replay.record`)
against the current workflow code with temporalio's Replayer.

A failure here means a workflow change would break workflows that are running right now (a non-determinism error
on their next task after a deploy): put the change behind `workflow.patched` (workflows/README.md), do not
re-record to make it pass.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from tinkerflow.workers.workflow_worker import WORKFLOWS

HISTORIES = sorted((Path(__file__).parent / "histories").glob("*.json"))


def _load(path: Path) -> WorkflowHistory:
    recorded = json.loads(path.read_text())
    return WorkflowHistory.from_json(recorded["workflow_id"], recorded["history"])


def test_the_recorded_scenarios_are_all_there():
    """training, sampling, checkpoints (expiry timers), recovery and the session timeout each left histories."""
    types = {p.name.rsplit("-", 1)[0] for p in HISTORIES}
    assert {"Session", "TrainingRun", "Coordinator", "SampleRequest", "CheckpointExpiry"} <= types, types

    def timed_out(path: Path) -> bool:  # ended on its own timer, never having heard a heartbeat
        events = json.loads(path.read_text())["history"]["events"]
        return (
            events[-1]["eventType"] == "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED"
            and any(e["eventType"] == "EVENT_TYPE_TIMER_FIRED" for e in events)
            and not any(e["eventType"] == "EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED" for e in events)
        )

    assert any(timed_out(p) for p in HISTORIES if p.name.startswith("Session-")), "no recorded session timed out"


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
def test_history_replays_on_the_current_workflow_code(path: Path):
    result = asyncio.run(Replayer(workflows=WORKFLOWS).replay_workflow(_load(path), raise_on_replay_failure=False))
    assert result.replay_failure is None, f"{path.name}: {result.replay_failure}"
