"""SampleRequestWorkflow: one short workflow per batch of `asample` calls, id `sample/<sampler_id>/<batch id>`.

RL clients fire hundreds of concurrent samples; funnelling them as updates into one workflow would hit its
in-flight-update limit (docs/architecture.md §Temporal facts that shape the code). The API coalesces the calls on one
sampler that arrive while its previous start is in flight into one of these workflows (one start, one signal to the
Coordinator, one result), so Temporal work per sample shrinks as load grows; the Coordinator batches them into shared
decode passes. Its result outlives it, so every future survives restarts of everything else.

A call lost with its JAX worker (killed or restarted while the call was queued on it or running) is sent again, once:
sampling changes no state, the body carries the same seed, and the Coordinator loads the sampler's weights on a live
worker first. Only a call that cannot be served then fails, saying why."""

from __future__ import annotations

from temporalio import workflow

from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import Outcome, SampleParams, SampleStart, WorkKind, WorkResult
from tinkerflow.workflows.protocol.usage import OpUsage, add_to, hour_of, ledger_memo
from tinkerflow.workflows.requester import CoordinatorCalls

# Calls answered worker-lost are sent again once. Patched: it signals the Coordinator where the calls were answered.
PATCH_RERUN_LOST = "sample-rerun-lost-v1"
# The calls' metered usage recorded in the memo (two upserts, new commands: patched).
PATCH_USAGE_MEMO = "sample-usage-memo-v1"


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
        params = [{"sample": c} for c in counted]

        async def send(which: list[int]) -> list[Outcome]:
            return await self._calls.call_many(
                coordinator,
                WorkKind.SAMPLE,
                [start.payloads[i] for i in which],
                session_id=names.session_of(sampler.sampler_id),
                snapshot=sampler.snapshot,
                item_params=[params[i] for i in which],
            )

        outcomes = await send(list(range(len(start.payloads))))
        lost = [i for i, o in enumerate(outcomes) if o.worker_lost]
        if lost and workflow.patched(PATCH_RERUN_LOST):
            workflow.logger.warning("%d sample call(s) lost with their JAX worker: sent again", len(lost))
            for i, outcome in zip(lost, await send(lost), strict=True):
                outcomes[i] = outcome
        if workflow.patched(PATCH_USAGE_MEMO):
            self._record_usage(start, outcomes)
        return outcomes

    @staticmethod
    def _record_usage(start: SampleStart, outcomes: list[Outcome]) -> None:
        """Meter the calls' final answers (a call sent again counts once: only its last answer is here) into this
        workflow's memo, with the owner and session as search attributes: the billing routes find every batch of a
        tenant in one visibility listing, memo included, without a query per workflow."""
        ledger: dict[str, OpUsage] = {}
        add_to(ledger, hour_of(workflow.now()), sum((o.usage or OpUsage() for o in outcomes if o.ok), OpUsage()))
        if not ledger:
            return
        sampler = start.sampler
        workflow.upsert_memo(
            {
                "usage": ledger_memo(ledger),
                "session_id": names.session_of(sampler.sampler_id),
                "base_model": sampler.base_model,
            }
        )
        workflow.upsert_search_attributes(  # pyright: ignore[reportUnknownMemberType] (temporalio's bare generic)
            [
                names.OWNER.value_set(names.owner_value(sampler.owner)),
                names.SESSION_ID.value_set(names.session_of(sampler.sampler_id)),
            ]
        )

    @workflow.signal
    def deliver(self, result: WorkResult) -> None:
        self._calls.on_deliver(result)
