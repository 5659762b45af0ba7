"""The workflow worker process: hosts every tinkerflow workflow. Stateless; run as many as you like."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging

from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from tinkerflow.activities.storage_activities import StorageActivities
from tinkerflow.common.checkpoints import CheckpointStore
from tinkerflow.common.settings import Settings
from tinkerflow.common.store import ClaimCheckStore
from tinkerflow.common.temporal import connect, ensure_search_attributes
from tinkerflow.workflows import protocol
from tinkerflow.workflows.checkpoint_expiry import CheckpointExpiry
from tinkerflow.workflows.coordinator.workflow import Coordinator
from tinkerflow.workflows.janitor import WORKFLOW_ID as JANITOR_ID
from tinkerflow.workflows.janitor import StoreJanitor
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.sample_request import SampleRequestWorkflow
from tinkerflow.workflows.session import SessionWorkflow
from tinkerflow.workflows.training_run import TrainingRunWorkflow

log = logging.getLogger(__name__)
WORKFLOWS = [SessionWorkflow, TrainingRunWorkflow, Coordinator, SampleRequestWorkflow, CheckpointExpiry, StoreJanitor]
#: The protocol package: pure data (frozen dataclasses, enums and id helpers: no state, no I/O, no clock). The sandbox
#: re-executes every module a workflow imports for each new workflow run (a SampleRequest per batch of sample calls,
#: each continue-as-new); py-spy under the mixed loop found ~40% of this process's CPU re-creating these dataclasses
#: (docs/benchmarks.md). Passed through, they are imported once and shared; the workflows themselves stay
#: sandboxed, so their determinism checks are unchanged. The sandbox passes a listed package's submodules through with
#: it, so a module added to the protocol is shared without being named here.
SHARED_PACKAGES = (protocol.__name__,)


def workflow_runner() -> SandboxedWorkflowRunner:
    return SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules(*SHARED_PACKAGES))


async def serve(settings: Settings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    client = await connect(settings)
    await ensure_search_attributes(client, settings.temporal_namespace)
    storage = StorageActivities(
        CheckpointStore(settings.resolved_checkpoint_root),
        ClaimCheckStore(settings.resolved_store_url),
        retention_s=settings.store_retention_s,
    )
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="storage")
    worker = Worker(
        client,
        task_queue=names.WORKFLOW_TASK_QUEUE,
        workflows=WORKFLOWS,
        activities=[storage.delete_expired_checkpoint, storage.delete_internal_checkpoint, storage.sweep_claim_checks],
        activity_executor=executor,
        max_concurrent_workflow_tasks=200,
        max_cached_workflows=settings.workflow_cache_size,
        workflow_runner=workflow_runner(),
    )
    log.info("workflow worker polling %s on %s", names.WORKFLOW_TASK_QUEUE, settings.temporal_address)
    async with worker:
        if settings.store_retention_s > 0:
            await client.start_workflow(
                StoreJanitor.run,
                min(3600.0, settings.store_retention_s / 4),
                id=JANITOR_ID,
                task_queue=names.WORKFLOW_TASK_QUEUE,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                static_summary=f"collects claim-check objects older than {settings.store_retention_s:g}s",
            )
        if ready is not None:
            ready.set()
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    executor.shutdown(wait=False, cancel_futures=True)
