"""How a workflow asks the Coordinator for engine work and waits for the answer (a `deliver` signal back)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow

from tinkerflow.workflows.protocol.messages import BlobRef, Outcome, WorkItem, WorkKind, WorkResult


class CoordinatorCalls:
    """Composition helper: each workflow owns one and forwards its `deliver` signal to `on_deliver`."""

    def __init__(self) -> None:
        self._answers: dict[str, Outcome] = {}
        self._waiting: set[str] = set()
        self._counter = 0

    def on_deliver(self, result: WorkResult) -> None:
        if result.key in self._waiting:  # late duplicates (a retried delivery) are dropped
            self._answers[result.key] = result.outcome

    async def call(
        self,
        coordinator_id: str,
        kind: WorkKind,
        *,
        model_id: str = "",
        session_id: str = "",
        payload: BlobRef | None = None,
        wait: bool = True,
        timeout: timedelta | None = None,
        **params: Any,
    ) -> Outcome:
        """`params`: the item's typed parameter fields for this kind (WorkItem: lora=, adam=, snapshot=, ...)."""
        info = workflow.info()
        self._counter += 1
        key = f"{info.run_id}-{self._counter}"
        item = WorkItem(
            key=key,
            requester=info.workflow_id,
            kind=kind,
            model_id=model_id,
            session_id=session_id,
            payload=payload,
            **params,
        )
        if wait:
            # Before the submit: the answer may arrive in the same activation that completes the signal.
            self._waiting.add(key)
        try:
            await workflow.get_external_workflow_handle(coordinator_id).signal("submit", item)
        except Exception as e:
            self._waiting.discard(key)
            return Outcome.failed(
                f"no coordinator {coordinator_id!r} is running: is a JAX worker serving it? ({e})", "user"
            )
        if not wait:
            return Outcome()
        # No timer in the common case: a timer per op costs a command and a workflow task. The coordinator answers
        # every item it routes (its activity has timeouts and a retry limit, a failed batch is answered as failed);
        # only an item waiting for a worker to exist at all waits unanswered, and callers that expect that (recovery
        # after a worker died) pass a timeout.
        try:
            await workflow.wait_condition(lambda: key in self._answers, timeout=timeout)
        except TimeoutError:
            self._waiting.discard(key)
            return Outcome.failed(f"no JAX worker took {kind} within {timeout}", "server")
        self._waiting.discard(key)
        return self._answers.pop(key)

    async def call_many(
        self,
        coordinator_id: str,
        kind: WorkKind,
        payloads: list[BlobRef],
        *,
        session_id: str = "",
        item_params: list[dict[str, Any]] | None = None,
        **params: Any,
    ) -> list[Outcome]:
        """Like `call` for many items of one kind, handed over in ONE signal (a batch of sample calls); `params` are
        every item's typed fields, `item_params` each item's own."""
        info = workflow.info()
        keys: list[str] = []
        items: list[WorkItem] = []
        for n, payload in enumerate(payloads):
            self._counter += 1
            key = f"{info.run_id}-{self._counter}"
            keys.append(key)
            self._waiting.add(key)
            items.append(
                WorkItem(
                    key=key,
                    requester=info.workflow_id,
                    kind=kind,
                    session_id=session_id,
                    payload=payload,
                    **{**params, **(item_params[n] if item_params else {})},
                )
            )
        try:
            await workflow.get_external_workflow_handle(coordinator_id).signal("submit_many", items)
        except Exception as e:
            self._waiting.difference_update(keys)
            failed = Outcome.failed(
                f"no coordinator {coordinator_id!r} is running: is a JAX worker serving it? ({e})", "user"
            )
            return [failed] * len(keys)
        await workflow.wait_condition(lambda: all(k in self._answers for k in keys))
        self._waiting.difference_update(keys)
        return [self._answers.pop(k) for k in keys]
