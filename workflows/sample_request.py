"""SampleRequestWorkflow: one short workflow per `asample` call, id `sample/<sampler_id>/<seq_id>-<hash>`.

RL clients fire hundreds of concurrent samples; funnelling them as updates into one workflow would hit its
in-flight-update limit (DESIGN §7). A workflow per call scales with Temporal itself; the Coordinator still batches
them into shared decode passes. Its result outlives it, so the future survives restarts of everything else.
"""

from __future__ import annotations

from temporalio import workflow

from tinkerflow.workflows import names
from tinkerflow.workflows.messages import Outcome, SampleStart, WorkResult
from tinkerflow.workflows.requester import CoordinatorCalls


@workflow.defn(name="SampleRequest")
class SampleRequestWorkflow:
    def __init__(self) -> None:
        self._calls = CoordinatorCalls()

    @workflow.run
    async def run(self, start: SampleStart) -> Outcome:
        sampler = start.sampler
        coordinator = names.coordinator_workflow_id(sampler.base_model, sampler.pool)
        return await self._calls.call(
            coordinator, "sample", session_id=names.session_of(sampler.sampler_id), payload=start.payload,
            params={"snapshot": sampler.snapshot, "sampler_id": sampler.sampler_id},
        )

    @workflow.signal
    def deliver(self, result: WorkResult) -> None:
        self._calls.on_deliver(result)
