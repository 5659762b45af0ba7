"""The workflow worker process: hosts every tinkerflow workflow. Stateless; run as many as you like."""

from __future__ import annotations

import asyncio
import logging

from temporalio.worker import Worker

from tinkerflow.common.settings import Settings
from tinkerflow.common.temporal import connect, ensure_search_attributes
from tinkerflow.workflows import names
from tinkerflow.workflows.coordinator import Coordinator
from tinkerflow.workflows.sample_request import SampleRequestWorkflow
from tinkerflow.workflows.session import SessionWorkflow
from tinkerflow.workflows.training_run import TrainingRunWorkflow

log = logging.getLogger(__name__)
WORKFLOWS = [SessionWorkflow, TrainingRunWorkflow, Coordinator, SampleRequestWorkflow]


async def serve(settings: Settings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    client = await connect(settings)
    await ensure_search_attributes(client, settings.temporal_namespace)
    worker = Worker(client, task_queue=names.WORKFLOW_TASK_QUEUE, workflows=WORKFLOWS,
                    max_concurrent_workflow_tasks=200)
    log.info("workflow worker polling %s on %s", names.WORKFLOW_TASK_QUEUE, settings.temporal_address)
    async with worker:
        if ready is not None:
            ready.set()
        await (stop.wait() if stop is not None else asyncio.Event().wait())
