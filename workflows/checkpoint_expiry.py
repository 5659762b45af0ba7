"""CheckpointExpiry: one per checkpoint with a TTL, id `checkpoint-expiry/<run>/<kind>/<name>` (docs/wire-contract.md
§RestClient routes).

The expiry is a durable Temporal timer: it fires on time across worker and server restarts, and the workflow then
runs the `delete_expired_checkpoint` activity, which removes the files only if the checkpoint still carries that
expiry (a TTL changed or removed meanwhile, or a re-save of the name, leaves it alone). `set_expiry` moves the
timer (the REST `ttl` route and every save of the name signal it); `None` ends the workflow with the files kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

from tinkerflow.workflows.protocol import names


@dataclass(frozen=True)
class ExpiryStart:
    tinker_path: str
    expires_at: str | None  # RFC3339
    base_model: str = ""
    pool: str = "default"


def parse_rfc3339(s: str) -> datetime:
    return datetime.fromisoformat(s.replace("Z", "+00:00"))


@workflow.defn(name="CheckpointExpiry")
class CheckpointExpiry:
    @workflow.init
    def __init__(self, start: ExpiryStart) -> None:
        self._expires_at = start.expires_at
        self._changed = False

    @workflow.run
    async def run(self, start: ExpiryStart) -> str:
        while True:
            if self._expires_at is None:
                return "expiry removed; the checkpoint is kept"
            workflow.set_current_details(f"deletes {start.tinker_path} at {self._expires_at}")
            delay = parse_rfc3339(self._expires_at) - workflow.now()
            self._changed = False
            if delay > timedelta(0):
                try:
                    await workflow.wait_condition(
                        lambda: self._changed, timeout=delay, timeout_summary=f"expire {start.tinker_path}"
                    )
                    continue  # moved or removed: start over with the new expiry
                except TimeoutError:
                    pass
            deleted = await workflow.execute_activity(
                "delete_expired_checkpoint",
                args=[start.tinker_path, self._expires_at],
                result_type=bool,
                start_to_close_timeout=timedelta(minutes=5),  # on this workflow's own task queue
                retry_policy=RetryPolicy(maximum_interval=timedelta(minutes=1)),
                summary=f"delete expired {start.tinker_path}",
            )
            if self._changed:  # the TTL moved while the delete ran; it deleted nothing (expiry mismatch)
                continue
            if deleted and start.base_model:
                # A sampler that has these weights loaded must not keep serving them.
                coordinator = workflow.get_external_workflow_handle(
                    names.coordinator_workflow_id(start.base_model, start.pool)
                )
                try:
                    await coordinator.signal("forget_checkpoint", start.tinker_path)
                except Exception as e:
                    workflow.logger.info("coordinator not told about %s: %s", start.tinker_path, e)
            return f"deleted {start.tinker_path}" if deleted else "already gone or re-saved"

    @workflow.signal
    def set_expiry(self, expires_at: str | None) -> None:
        self._expires_at = expires_at
        self._changed = True
