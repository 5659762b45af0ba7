"""StoreJanitor: one per deployment, id `janitor/claim-check-store`; every interval it runs `sweep_claim_checks`,
which collects request bodies and results older than the retention (docs/architecture.md §The claim-check data path).
A workflow rather than a thread in some process: it runs exactly once however many workflow workers there are, and
its history shows what it did."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

WORKFLOW_ID = "janitor/claim-check-store"
SWEEPS_PER_RUN = 100  # then continue-as-new: a forever-loop must not grow its history without bound


@workflow.defn(name="StoreJanitor")
class StoreJanitor:
    @workflow.run
    async def run(self, every_s: float) -> None:
        for _ in range(SWEEPS_PER_RUN):
            swept = await workflow.execute_activity(
                "sweep_claim_checks",
                result_type=dict,  # on this workflow's own task queue
                start_to_close_timeout=timedelta(minutes=30),
                retry_policy=RetryPolicy(maximum_attempts=3),
                summary="collect old claim-check objects",
            )
            workflow.set_current_details(
                f"last sweep collected {swept.get('objects', 0)} objects ({swept.get('bytes', 0):,} bytes)"
            )
            await workflow.sleep(timedelta(seconds=every_s), summary="until the next sweep")
        workflow.continue_as_new(every_s)
