"""SampleRequestWorkflow: one short workflow per batch of `asample` calls, id `sample/<sampler_id>/<batch id>`.

RL clients fire hundreds of concurrent samples; funnelling them as updates into one workflow would hit its
in-flight-update limit (docs/architecture.md §Temporal facts that shape the code). The API coalesces the calls on one
sampler that arrive while its previous start is in flight into one of these workflows (one start, one signal to the
Coordinator, one result), so Temporal work per sample shrinks as load grows; the Coordinator batches them into shared
decode passes. Its result outlives it, so every future survives restarts of everything else."""

from __future__ import annotations

from temporalio import workflow

from tinkerflow.workflows import names
from tinkerflow.workflows.messages import Outcome, SampleParams, SampleStart, WorkKind, WorkResult
from tinkerflow.workflows.requester import CoordinatorCalls


@workflow.defn(name="SampleRequest")
class SampleRequestWorkflow:
    def __init__(self) -> None:
        self._calls = CoordinatorCalls()

    @workflow.run
    async def run(self, start: SampleStart) -> list[Outcome]:
        sampler = start.sampler
        coordinator = names.coordinator_workflow_id(sampler.base_model, sampler.pool)
        workflow.set_current_details(f"{len(start.payloads)} sample call(s) on {sampler.sampler_id}")
        counted = [SampleParams(sampler_id=sampler.sampler_id)] * len(start.payloads)
        if start.work and workflow.patched("sample-work"):  # patched: the items' params change what is signalled
            counted = [
                SampleParams(sampler_id=sampler.sampler_id, samples=s, work=w)
                for s, w in zip(start.samples, start.work, strict=True)
            ]
        return await self._calls.call_many(
            coordinator,
            WorkKind.SAMPLE,
            start.payloads,
            session_id=names.session_of(sampler.sampler_id),
            snapshot=sampler.snapshot,
            item_params=[{"sample": c} for c in counted],
        )

    @workflow.signal
    def deliver(self, result: WorkResult) -> None:
        self._calls.on_deliver(result)
