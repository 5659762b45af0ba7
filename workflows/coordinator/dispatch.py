"""The batches the Coordinator has in flight on each worker: the one running and, on a worker that takes them in
order, the next one already queued behind it (pipelined dispatch).

A worker that says it holds batches in dispatch order (`WorkerInfo.pipeline_depth` > 1) is given its next batch
while its current one runs, up to PIPELINE_DEPTH batches in flight: the batch waits on the worker's own task queue,
and the worker starts it the moment the one before ends, instead of after a round trip through the Coordinator (the
finished activity recorded in its history, a workflow task that forms the next batch, the activity scheduled and
polled). Each batch names the one it follows (`Batch.after`), so the worker runs them in that order whatever order
its task queue hands them over in.

What the pipelining keeps:
- Exactly once: an item is taken from the queue into one batch only, and the worker remembers answers by item key.
- Incarnations: every batch carries the incarnation it was placed for, and a worker that restarted refuses it. A
  batch that fails as lost (its worker died or restarted) takes the batches behind it on that worker with it: they
  are cancelled and answered as lost, so none waits for a predecessor that will never run.
- Paging: the runs with an item in any batch in flight on a worker are pinned while its next batch is formed
  (paging.BatchPlan): the queued batch never pages out a run whose op is still running or waiting to run.

Workflow code (deterministic, stdlib only); the Coordinator holds one `Pipelines`. Not carried across
continue-as-new: the Coordinator drains every batch before it continues.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from temporalio import workflow

from tinkerflow.workflows.protocol.messages import WorkItem, WorkKind
from tinkerflow.workflows.protocol.work import KIND_LABELS

# The running batch and one queued behind it: enough that the worker never waits for the Coordinator, while
# everything that arrives later still gathers into the batch after (deeper would split the queue into more, smaller
# batches for no gain).
PIPELINE_DEPTH = 2


@dataclass
class InFlight:
    """One batch dispatched to a worker and not yet answered."""

    batch_id: str
    models: frozenset[str]  # the runs it has items of (pinned while a later batch is formed)
    activity: workflow.ActivityHandle[Any] | None = None  # None until its task has scheduled it
    cancelled: bool = False

    def answered(self) -> bool:
        """Whether its activity has already completed (its answers are in hand, to be read)."""
        return self.activity is not None and self.activity.done()

    def cancel(self) -> None:
        """Its worker was lost: the activity cancelled (or, not scheduled yet, never scheduled); the Coordinator
        answers its items as lost. One that already completed keeps its answers: the worker ran it."""
        self.cancelled = True
        if self.activity is not None and not self.activity.done():
            self.activity.cancel()


@dataclass
class Pipelines:
    by_queue: dict[str, list[InFlight]] = field(default_factory=dict[str, list[InFlight]])

    def __bool__(self) -> bool:
        return any(self.by_queue.values())

    def count(self, queue: str) -> int:
        return len(self.by_queue.get(queue, ()))

    def busy(self) -> set[str]:
        """Workers with a batch in flight."""
        return {q for q, batches in self.by_queue.items() if batches}

    def last(self, queue: str) -> str:
        """The id of the newest batch in flight on `queue` ("" when none): the one a new batch follows."""
        batches = self.by_queue.get(queue)
        return batches[-1].batch_id if batches else ""

    def pinned(self, queue: str) -> frozenset[str]:
        """The runs with an item in a batch in flight on `queue`."""
        return frozenset(m for b in self.by_queue.get(queue, ()) for m in b.models)

    def add(self, queue: str, batch_id: str, items: list[WorkItem]) -> InFlight:
        entry = InFlight(batch_id, frozenset(i.model_id for i in items if i.model_id and i.kind is not WorkKind.PAGE))
        self.by_queue.setdefault(queue, []).append(entry)
        return entry

    def remove(self, queue: str, entry: InFlight) -> None:
        batches = self.by_queue.get(queue, [])
        if entry in batches:
            batches.remove(entry)
        if not batches:
            self.by_queue.pop(queue, None)

    def behind(self, queue: str, entry: InFlight) -> list[InFlight]:
        """The batches dispatched to `queue` after `entry`, still in flight."""
        batches = self.by_queue.get(queue, [])
        return batches[batches.index(entry) + 1 :] if entry in batches else []

    def all_on(self, queue: str) -> list[InFlight]:
        return list(self.by_queue.get(queue, ()))


def summarise(items: list[WorkItem]) -> str:
    """A batch as the Temporal UI shows its activity: "fwd/bwd ×3 · optim ×1 · 4 run(s)"."""
    counts: dict[WorkKind, int] = {}
    for i in items:
        counts[i.kind] = counts.get(i.kind, 0) + 1
    runs = len({i.model_id for i in items if i.model_id})
    parts = [f"{KIND_LABELS.get(k, k)} ×{n}" for k, n in counts.items()]
    return " · ".join(parts) + (f" · {runs} run(s)" if runs else "")
