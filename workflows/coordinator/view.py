"""What the Coordinator's `describe` query answers: its workers and their slots, the runs it holds (resident or
paged out), and the work waiting. A query never enters history, so this reads the state and changes nothing."""

from __future__ import annotations

from typing import Any

from tinkerflow.workflows.coordinator.dispatch import Pipelines
from tinkerflow.workflows.coordinator.paging import live_per_worker
from tinkerflow.workflows.coordinator.state import CoordinatorState
from tinkerflow.workflows.protocol.messages import WorkKind


def describe(s: CoordinatorState, pipelines: Pipelines) -> dict[str, Any]:
    live = live_per_worker(s)
    return {
        "base_model": s.base_model,
        "pool": s.pool,
        "workers": {
            q: {
                "worker_id": w.info.worker_id,
                "slots_used": len(w.slots),
                "max_adapters": w.info.max_adapters,
                "max_paged": w.info.max_paged,
                "runs_live": live[q],
                "busy": pipelines.count(q) > 0,
                "batches_in_flight": pipelines.count(q),
            }
            for q, w in s.workers.items()
        },
        # Slots as a cache (paging.py): runs with an adapter on some worker, resident or paged out, and the
        # page moves asked for so far.
        "runs_live": len(s.placements),
        "runs_paged": sum(1 for _, slot in s.placements.values() if slot < 0),
        "page_ins": s.page_ins,
        "page_outs": s.page_outs,
        "placements": dict(s.placements),
        "snapshots": len(s.snapshots),
        "pending": len(s.pending),
        # Work, not calls: one asample may ask for many samples of many tokens (items without the counts are
        # one sample of unknown length).
        "pending_samples": sum(i.sample.samples if i.sample else 1 for i in s.pending if i.kind is WorkKind.SAMPLE),
        "pending_sample_tokens": sum(i.sample.work if i.sample else 0 for i in s.pending if i.kind is WorkKind.SAMPLE),
        "dispatched_batches": s.dispatched_batches,
    }
