"""The workflow worker's sandbox shares the protocol's pure-data modules across workflow runs instead of re-executing
them for each new run (~40% of the workflow worker's CPU under the mixed loop went there)."""

from __future__ import annotations

import uuid

from temporalio.worker import Worker

from tests.workflows.sandbox_probe import SandboxProbe
from tests.workflows.wf_harness import unique_queue
from tinkerflow.workers.workflow_worker import workflow_runner
from tinkerflow.workflows.protocol.messages import Outcome


async def _probe_ids(client, runner, runs: int = 2) -> list[int]:
    queue = unique_queue("sandbox")
    kwargs = {"workflow_runner": runner} if runner is not None else {}
    async with Worker(client, task_queue=queue, workflows=[SandboxProbe], **kwargs):
        return [
            await client.execute_workflow(SandboxProbe.run, id=f"probe-{uuid.uuid4().hex}", task_queue=queue)
            for _ in range(runs)
        ]


async def test_every_workflow_run_sees_the_one_imported_message_classes(temporal_env):
    assert await _probe_ids(temporal_env.client, workflow_runner()) == [id(Outcome), id(Outcome)]


async def test_the_default_sandbox_would_recreate_them_per_run(temporal_env):
    """What the runner saves: without the pass-through, each run executes messages.py anew (its own classes)."""
    assert id(Outcome) not in await _probe_ids(temporal_env.client, None)
