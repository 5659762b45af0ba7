"""How a workflow asks the Coordinator for engine work and waits for the answer (a `deliver` signal back)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow

from tinkerflow.workflows.messages import BlobRef, Outcome, WorkItem, WorkResult

# Longer than the coordinator's activity timeout × attempts: reaching it means the coordinator lost the item.
ANSWER_TIMEOUT = timedelta(hours=2)


class CoordinatorCalls:
    """Composition helper: each workflow owns one and forwards its `deliver` signal to `on_deliver`."""

    def __init__(self) -> None:
        self._answers: dict[str, Outcome] = {}
        self._counter = 0

    def on_deliver(self, result: WorkResult) -> None:
        self._answers[result.key] = result.outcome

    async def call(
        self,
        coordinator_id: str,
        kind: str,
        *,
        model_id: str = "",
        session_id: str = "",
        payload: BlobRef | None = None,
        params: dict[str, Any] | None = None,
        wait: bool = True,
    ) -> Outcome:
        info = workflow.info()
        self._counter += 1
        key = f"{info.run_id}-{self._counter}"
        item = WorkItem(
            key=key, requester=info.workflow_id, kind=kind, model_id=model_id, session_id=session_id,
            payload=payload, params=params or {},
        )
        try:
            await workflow.get_external_workflow_handle(coordinator_id).signal("submit", item)
        except Exception as e:
            return Outcome.failed(f"no coordinator {coordinator_id!r} is running: is a JAX worker serving it? ({e})",
                                  "user")
        if not wait:
            return Outcome()
        try:
            await workflow.wait_condition(lambda: key in self._answers, timeout=ANSWER_TIMEOUT)
        except TimeoutError:
            return Outcome.failed(f"no answer from {coordinator_id} within {ANSWER_TIMEOUT}", "server")
        return self._answers.pop(key)
