"""The shared acceptance script, unchanged, against the real stack; and the UI-facing names in Temporal."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import Client

from tests.e2e.conftest import run_acceptance_script

pytestmark = pytest.mark.e2e


def test_pig_latin_acceptance_script(stack):
    run_acceptance_script(stack, "pig_latin.py", timeout_s=900)


def test_session_and_run_are_findable_by_readable_ids(stack, service_client, training_client):
    model_id = training_client.model_id
    session_id = model_id.split(":")[0]

    async def find() -> tuple[list, list, list]:
        client = await Client.connect(stack.temporal_address)
        found = []
        for query in (
            f"WorkflowId = 'session/{session_id}'",
            f"WorkflowId = 'training-run/{model_id}'",
            f"TinkerflowSessionId = '{session_id}'",
        ):
            rows = []
            for _ in range(50):  # visibility is eventually consistent
                rows = [wf async for wf in client.list_workflows(query)]
                if rows:
                    break
                await asyncio.sleep(0.2)
            found.append(rows)
        return tuple(found)

    sessions, runs, by_attribute = asyncio.run(find())
    assert [wf.workflow_type for wf in sessions] == ["Session"]
    assert [wf.workflow_type for wf in runs] == ["TrainingRun"]
    assert {wf.id for wf in by_attribute} >= {f"session/{session_id}", f"training-run/{model_id}"}
