"""Coalesce concurrent asample calls on one sampler into one SampleRequestWorkflow (natural batching).

The first call on a sampler starts its workflow at once; calls arriving while that start is in flight wait and go
together into the next one. A lone caller waits for nothing, and under RL load (hundreds of concurrent calls) one
workflow start, one coordinator signal and one result carry many samples. Nothing here outlives a request: a call
gets its request_id only after its workflow has started, so a crash before that is retried by the SDK.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy

from tinkerflow.common.metrics import SAMPLE_BATCHES
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import BlobRef, SamplerInfo, SampleStart
from tinkerflow.workflows.sample_request import SampleRequestWorkflow

MAX_CALLS_PER_WORKFLOW = 64


@dataclass
class _Queue:
    waiting: list[tuple[BlobRef, int, int, asyncio.Future]] = field(default_factory=list)  # payload, samples, work
    starting: bool = False


class SampleBatcher:
    def __init__(self, client: Client):
        self._client = client
        self._queues: dict[str, _Queue] = {}
        # The event loop holds tasks weakly: a drain nobody references could be collected mid-batch.
        self._drains: set[asyncio.Task[None]] = set()

    async def submit(
        self, sampler: SamplerInfo, payload: BlobRef, *, samples: int = 1, work: int = 0
    ) -> tuple[str, int]:
        """Queue one call; returns (workflow id, index of this call in that workflow's result list)."""
        queue = self._queues.setdefault(sampler.sampler_id, _Queue())
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        queue.waiting.append((payload, samples, work, future))
        if not queue.starting:
            queue.starting = True
            drain = asyncio.create_task(self._drain(sampler, queue))
            self._drains.add(drain)
            drain.add_done_callback(self._drains.discard)
        return await future

    async def _drain(self, sampler: SamplerInfo, queue: _Queue) -> None:
        try:
            while queue.waiting:
                batch, queue.waiting = queue.waiting[:MAX_CALLS_PER_WORKFLOW], queue.waiting[MAX_CALLS_PER_WORKFLOW:]
                workflow_id = names.sample_workflow_id(sampler.sampler_id, uuid.uuid4().hex[:16])
                try:
                    await self._client.start_workflow(
                        SampleRequestWorkflow.run,
                        SampleStart(
                            sampler=sampler,
                            payloads=[b[0] for b in batch],
                            samples=[b[1] for b in batch],
                            work=[b[2] for b in batch],
                        ),
                        id=workflow_id,
                        task_queue=names.WORKFLOW_TASK_QUEUE,
                        id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                        static_summary=f"{len(batch)} sample call(s) on {sampler.sampler_id}",
                    )
                except Exception as e:
                    for *_, future in batch:
                        if not future.done():
                            future.set_exception(e)
                    continue
                SAMPLE_BATCHES.inc()
                for index, (*_, future) in enumerate(batch):
                    if not future.done():
                        future.set_result((workflow_id, index))
        finally:
            queue.starting = False
