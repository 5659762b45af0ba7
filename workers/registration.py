"""A JAX worker's registration with the Coordinator of its base model (signal-with-start), and the re-registering
that lets a Coordinator which took it for dead, or was reset, take it back."""

from __future__ import annotations

import asyncio
import logging

from temporalio.client import WorkflowHandle
from temporalio.common import WorkflowIDConflictPolicy

from tinkerflow.common.settings import Settings
from tinkerflow.workflows.coordinator.state import CoordinatorState
from tinkerflow.workflows.coordinator.workflow import Coordinator
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import WorkerInfo

log = logging.getLogger(__name__)
REREGISTER_EVERY_S = 30.0


async def keep_registered(client, settings: Settings, info: WorkerInfo) -> None:
    """Register again now and then: a coordinator that took this worker for dead (a batch timed out while the
    machine was overloaded) or was reset takes it back; for one that knows it, this is a no-op."""
    while True:
        await asyncio.sleep(REREGISTER_EVERY_S)
        try:
            await register(client, settings, info)
        except Exception as e:
            log.warning("re-registering with the coordinator failed: %s", e)


async def register(client, settings: Settings, info: WorkerInfo) -> WorkflowHandle:
    card = info.card
    return await client.start_workflow(
        Coordinator.run,
        CoordinatorState(base_model=card.name, pool=settings.pool),
        id=names.coordinator_workflow_id(card.name, settings.pool),
        task_queue=names.WORKFLOW_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        start_signal="register_worker",
        start_signal_args=[info],
        memo={
            "model": {
                "name": card.name,
                "arch": card.arch,
                "local_path": card.local_path,
                "vocab_size": card.vocab_size,
                "max_context": card.max_context,
                "image_processor": card.image_processor,  # a few hundred bytes; None for a text-only model
            }
        },
        search_attributes=None,
        static_summary=f"batching for {card.name} on pool {settings.pool}",
    )
