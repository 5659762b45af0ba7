"""The workflow worker's sandbox shares the protocol's pure-data modules across workflow runs instead of re-executing
them for each new run (~40% of the workflow worker's CPU under the mixed loop went there): every module of the
package, a new one included, without a list to keep."""

from __future__ import annotations

import pkgutil
import uuid

from temporalio.worker import Worker

from tests.workflows.sandbox_probe import SandboxProbe
from tests.workflows.wf_harness import unique_queue
from tinkerflow.workers.workflow_worker import workflow_runner
from tinkerflow.workflows import protocol
from tinkerflow.workflows.protocol.messages import Outcome
from tinkerflow.workflows.protocol.usage import OpUsage


async def _probe_ids(client, runner, runs: int = 2) -> list[list[int]]:
    queue = unique_queue("sandbox")
    kwargs = {"workflow_runner": runner} if runner is not None else {}
    async with Worker(client, task_queue=queue, workflows=[SandboxProbe], **kwargs):
        return [
            await client.execute_workflow(SandboxProbe.run, id=f"probe-{uuid.uuid4().hex}", task_queue=queue)
            for _ in range(runs)
        ]


def _passed_through(name: str, configured: set[str]) -> bool:
    """As the sandbox decides: the module or one of its parent packages is listed."""
    parts = name.split(".")
    return any(".".join(parts[:n]) in configured for n in range(1, len(parts) + 1))


def test_every_protocol_module_is_passed_through():
    configured = workflow_runner().restrictions.passthrough_modules
    modules = [info.name for info in pkgutil.walk_packages(protocol.__path__, protocol.__name__ + ".")]
    assert {"tinkerflow.workflows.protocol.messages", "tinkerflow.workflows.protocol.usage"} <= set(modules)
    assert [m for m in modules if not _passed_through(m, configured)] == []


def test_no_workflow_module_outside_the_protocol_is_passed_through():
    """The workflows stay sandboxed: only the protocol's pure data is shared."""
    configured = workflow_runner().restrictions.passthrough_modules
    assert not _passed_through("tinkerflow.workflows.session", configured)
    assert not _passed_through("tinkerflow.workflows.coordinator.workflow", configured)


async def test_every_workflow_run_sees_the_one_imported_protocol_classes(temporal_env):
    want = [id(Outcome), id(OpUsage)]
    assert await _probe_ids(temporal_env.client, workflow_runner()) == [want, want]


async def test_the_default_sandbox_would_recreate_them_per_run(temporal_env):
    """What the runner saves: without the pass-through, each run executes messages.py and usage.py anew (its own
    classes)."""
    for ids in await _probe_ids(temporal_env.client, None):
        assert id(Outcome) not in ids and id(OpUsage) not in ids
