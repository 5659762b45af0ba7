"""The Coordinator's state: its workers and their slots, every live run's placement, sampler snapshots, the queue.

One dataclass carried across continue-as-new (JSON in history: string keys, new fields only with defaults). The
placement policy (placement.py) and the paging of adapters in and out of slots (paging.py) read and write it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tinkerflow.workflows.protocol.messages import WorkerInfo, WorkItem


@dataclass
class WorkerSlots:
    info: WorkerInfo
    slots: dict[str, str] = field(
        default_factory=dict[str, str]
    )  # str(slot) -> model_id (string keys: history is JSON)


@dataclass
class CoordinatorState:
    base_model: str
    pool: str
    workers: dict[str, WorkerSlots] = field(default_factory=dict[str, WorkerSlots])  # task queue -> worker
    # model_id -> [task queue, slot]; slot -1: paged out on that worker (paging.py)
    placements: dict[str, list[Any]] = field(default_factory=dict[str, list[Any]])
    snapshots: dict[str, str] = field(default_factory=dict[str, str])  # snapshot key -> task queue
    snapshot_runs: dict[str, str] = field(
        default_factory=dict[str, str]
    )  # ephemeral snapshot key -> model_id it came from
    snapshot_used: dict[str, float] = field(
        default_factory=dict[str, float]
    )  # snapshot key -> last time routed (epoch s)
    pending: list[WorkItem] = field(default_factory=list[WorkItem])
    dispatched_batches: int = 0
    # Slots as a cache (paging.py): each run's last use (a tick: least recently used is paged out first), the
    # owner of every live run (the per-tenant limit counts them; kept while a dead worker's runs restore), and
    # how many page moves were asked for.
    lru: dict[str, int] = field(default_factory=dict[str, int])
    lru_tick: int = 0
    owners: dict[str, str] = field(default_factory=dict[str, str])
    page_ins: int = 0
    page_outs: int = 0
