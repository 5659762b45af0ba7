"""How a training run restores its adapter after its JAX worker died (docs/architecture.md §What durability
promises): re-place it on a live worker, load the latest automatic snapshot, replay the ops logged since.

A part of `TrainingRunWorkflow` (training_run.py), kept apart because it is the run's recovery side. Like
`RunCheckpoints`, whose writes it uses, the class is a mixin with no state of its own; the workflow supplies `s`,
`_calls`, `_coordinator` and `_publish`.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

from tinkerflow.workflows.protocol.messages import LoadCheckpoint, Outcome, SaveRequest, TenantLimit, WorkKind
from tinkerflow.workflows.run_checkpoints import RunCheckpoints

# How long a run whose JAX worker died waits for a live worker to restore its adapter on.
RECOVERY_WAIT = timedelta(minutes=5)


class RunRecovery(RunCheckpoints):
    def _publish(self) -> None:
        raise NotImplementedError  # the workflow's visibility line (training_run.py)

    async def _create_adapter(self) -> Outcome:
        lora = self.s.lora_spec
        start = self.s.start
        return await self._calls.call(
            self._coordinator,
            WorkKind.CREATE_ADAPTER,
            model_id=start.model_id,
            session_id=start.session_id,
            lora=lora,
            tenant=TenantLimit(owner=start.owner, max_live_runs=start.max_live_runs),
            timeout=RECOVERY_WAIT if self.s.status == "ready" else None,
        )

    async def _auto_snapshot(self) -> None:
        path = f"tinker://{self.s.start.model_id}/auto_weights/latest"
        outcome = await self._write_checkpoint(path, SaveRequest(path="latest", overwrite=True))
        if outcome.ok:
            self.s.auto_snapshot, self.s.since_snapshot = path, []
        else:  # keep the log: recovery then replays from the previous snapshot
            workflow.logger.warning("automatic snapshot of %s failed: %s", self.s.start.model_id, outcome.error)

    async def _recover(self, why: str) -> Outcome:
        """Re-place the adapter on a live worker, load the latest automatic snapshot and replay the ops logged since:
        the exact state the dead worker held. Returns the last step's outcome: ok, or what went wrong."""
        if not self.s.start.snapshot_every:
            return Outcome.failed("automatic snapshots are off for this run (--auto-snapshot-every 0)", "server")
        self.s.recoveries += 1
        workflow.logger.warning(
            "restoring %s (%s): snapshot %s + %d ops",
            self.s.start.model_id,
            why,
            self.s.auto_snapshot or "none (fresh adapter)",
            len(self.s.since_snapshot),
        )
        workflow.set_current_details(f"restoring the adapter on a live JAX worker: {why}")
        outcome = await self._create_adapter()
        if outcome.ok and self.s.auto_snapshot:
            outcome = await self._calls.call(
                self._coordinator,
                WorkKind.LOAD_CHECKPOINT,
                model_id=self.s.start.model_id,
                load=LoadCheckpoint(path=self.s.auto_snapshot, optimizer=True),
            )
        for entry in self.s.since_snapshot:
            if not outcome.ok:
                break
            outcome = await self._calls.call(
                self._coordinator,
                WorkKind(entry.kind),
                model_id=self.s.start.model_id,
                payload=entry.payload,
                adam=entry.adam,
                load=entry.load,
            )
        self._publish()
        return outcome
