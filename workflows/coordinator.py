"""Coordinator: the batching brain for one base model on one pool of JAX workers (DESIGN §2).

Requester workflows (training runs, sample requests, sessions) `submit` WorkItems by signal. The coordinator places
adapters on workers (slot allocation), and while a worker is busy it queues that worker's work; the moment the worker
is free it dispatches everything queued for it as ONE activity on the worker's own task queue. Under load that is
natural batching (forward/backward of many runs in one pass, many sample calls in one decode batch) at no added
latency for a lone user. Each requester gets its share of the batch result back as a `deliver` signal.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.exceptions import TimeoutError as TimeoutError_

from tinkerflow.workflows.fairness import fair_order, growing
from tinkerflow.workflows.messages import Batch, BatchResult, Outcome, WorkerInfo, WorkItem, WorkResult

MAX_BATCH_ITEMS = 64
# Under load signals keep arriving while the continue-as-new task runs, so Temporal rejects that task once and the
# worker replays the whole history (~1.5 ms per event on 2 cores: 6 s at Temporal's ~4,100-event suggestion, during
# which nothing is dispatched). A shorter history keeps that stall to a few seconds, at a drain every ~2,000 events.
CONTINUE_AS_NEW_EVENTS = 2_000
# An ephemeral sampler snapshot (save_weights_and_get_sampling_client) is collected once a newer one of the same run
# exists and it has not been sampled for this long: RL loops make one per step, and none is reused for long.
EPHEMERAL_SNAPSHOT_IDLE_S = 120.0

KIND_LABELS = {
    "forward_backward": "fwd/bwd",
    "optim_step": "optim",
    "sample": "sample",
    "snapshot": "snapshot",
    "create_adapter": "create adapter",
    "free_adapter": "free adapter",
    "drop_snapshots": "drop snapshots",
    "save_checkpoint": "save checkpoint",
    "load_checkpoint": "load checkpoint",
    "load_snapshot": "load sampler weights",
}
SLOT_KINDS = ("forward_backward", "optim_step", "snapshot", "free_adapter", "save_checkpoint", "load_checkpoint")


@dataclass
class WorkerSlots:
    info: WorkerInfo
    # str(slot) -> model_id (string keys: history is JSON)
    slots: dict[str, str] = field(default_factory=dict[str, str])


@dataclass
class CoordinatorState:
    base_model: str
    pool: str
    workers: dict[str, WorkerSlots] = field(default_factory=dict[str, WorkerSlots])  # task queue -> worker
    placements: dict[str, list[Any]] = field(default_factory=dict[str, list[Any]])  # model_id -> [task queue, slot]
    snapshots: dict[str, str] = field(default_factory=dict[str, str])  # snapshot key -> task queue
    # ephemeral snapshot key -> model_id it came from
    snapshot_runs: dict[str, str] = field(default_factory=dict[str, str])
    # snapshot key -> last time routed (epoch s)
    snapshot_used: dict[str, float] = field(default_factory=dict[str, float])
    pending: list[WorkItem] = field(default_factory=list[WorkItem])
    dispatched_batches: int = 0


@workflow.defn(name="Coordinator")
class Coordinator:
    @workflow.init
    def __init__(self, state: CoordinatorState) -> None:
        self.s = state
        self._busy: set[str] = set()
        self._signals_in_flight = 0  # deliveries not yet sent; continue-as-new must not drop them
        # Set by every change that can make routing succeed (work submitted, worker registered, batch finished).
        # The loop wakes only on a change: routing that finds nothing to do must not spin (a workflow that loops
        # without yielding is killed by the deadlock detector and takes the whole base model down with it).
        self._changed = True

    @workflow.run
    async def run(self, state: CoordinatorState) -> None:
        while True:
            await workflow.wait_condition(lambda: self._changed)
            self._changed = False
            if self._should_continue_as_new():
                # Drain: dispatch nothing new; once no batch is in flight, carry the queue into a fresh run.
                if self._busy:
                    continue
                await workflow.wait_condition(lambda: workflow.all_handlers_finished() and not self._signals_in_flight)
                workflow.continue_as_new(self.s)
            for queue in self._ready_queues():
                items = self._take_for(queue)
                if items:
                    self._busy.add(queue)
                    # The workflow's event loop holds its tasks until they finish (temporalio keeps a set).
                    asyncio.ensure_future(self._dispatch(queue, items))  # noqa: RUF006

    def _should_continue_as_new(self) -> bool:
        info = workflow.info()
        return info.is_continue_as_new_suggested() or info.get_current_history_length() > CONTINUE_AS_NEW_EVENTS

    # --- messages ------------------------------------------------------------------------------------------------

    @workflow.signal
    def register_worker(self, info: WorkerInfo) -> None:
        previous = self.s.workers.get(info.task_queue)
        if previous is not None and previous.info.incarnation == info.incarnation:
            return  # the periodic re-registration of a live worker
        if previous is not None:
            # A restarted worker lost its in-memory adapters and snapshots: forget what we had placed there, so the
            # runs that lived on it restore themselves instead of silently training a fresh adapter.
            self._drop_worker(info.task_queue)
            workflow.logger.warning("worker %s re-registered; its adapters were lost", info.worker_id)
        self.s.workers[info.task_queue] = WorkerSlots(info=info)
        self._changed = True
        self._set_details()

    @workflow.signal
    def submit(self, item: WorkItem) -> None:
        self.s.pending.append(item)
        self._changed = True

    @workflow.signal
    def submit_many(self, items: list[WorkItem]) -> None:
        self.s.pending.extend(items)
        self._changed = True

    @workflow.signal
    def deliver(self, result: WorkResult) -> None:
        """Answers to work the coordinator queued for itself (snapshot collection); nothing waits for them."""
        if not result.outcome.ok:
            workflow.logger.warning("housekeeping %s failed: %s", result.key, result.outcome.error)

    @workflow.signal
    def forget_checkpoint(self, tinker_path: str) -> None:
        """A checkpoint was deleted or expired: drop it from the memory of the worker that loaded it."""
        queue = self.s.snapshots.get(tinker_path)
        if queue is None:
            return
        self._forget_snapshot(tinker_path)
        self.s.pending.append(WorkItem(key=f"forget-{tinker_path}-{workflow.uuid4().hex[:8]}",
                                       requester=workflow.info().workflow_id, kind="drop_snapshots",
                                       params={"keys": [tinker_path], "queue": queue}))
        self._changed = True

    @workflow.query
    def describe(self) -> dict[str, Any]:
        return {
            "base_model": self.s.base_model,
            "pool": self.s.pool,
            "workers": {
                q: {"worker_id": w.info.worker_id, "slots_used": len(w.slots), "max_adapters": w.info.max_adapters,
                    "busy": q in self._busy}
                for q, w in self.s.workers.items()
            },
            "placements": dict(self.s.placements),
            "snapshots": len(self.s.snapshots),
            "pending": len(self.s.pending),
            # Work, not calls: one asample may ask for many samples of many tokens (items without the counts are
            # one sample of unknown length).
            "pending_samples": sum(int(i.params.get("samples", 1)) for i in self.s.pending if i.kind == "sample"),
            "pending_sample_tokens": sum(int(i.params.get("work", 0)) for i in self.s.pending if i.kind == "sample"),
            "dispatched_batches": self.s.dispatched_batches,
        }

    # --- routing -------------------------------------------------------------------------------------------------

    def _ready_queues(self) -> list[str]:
        if not self.s.pending:
            return []
        return [q for q in self.s.workers if q not in self._busy]

    def _take_for(self, queue: str) -> list[WorkItem]:
        """Route pending items; return (with slots filled in) the ones for `queue`, answer unroutable ones now."""
        taken: list[WorkItem] = []
        keep: list[WorkItem] = []
        # Fair between tenants: items are considered round-robin over sessions rather than first come, so one
        # session's long queue cannot fill every batch ahead of another's single item. The bound: with T sessions
        # waiting, each session's oldest item is in the next batch (T <= MAX_BATCH_ITEMS), and its k-th oldest
        # within ceil(k * T / MAX_BATCH_ITEMS) batches. Patched: it changes which items a replayed batch held.
        source = self.s.pending
        pending = fair_order(source) if workflow.patched("coordinator-fair-order") else source
        queued = len(source)
        for item in growing(pending, source, queued):
            if len(taken) >= MAX_BATCH_ITEMS:
                keep.append(item)
                continue
            try:
                target, routed = self._route(item)
            except ApplicationError as e:
                outcome = Outcome(error=e.message, category="user", worker_lost=e.type == "AdapterLost")
                self._answer(WorkResult(key=item.key, outcome=outcome), item.requester)
                continue
            if target is None:
                keep.append(item)  # waits for a worker to register
            elif target == queue:
                taken.extend(self._loads_for(routed, queue))
                taken.append(routed)
            else:
                keep.append(item)
        self.s.pending = keep
        return taken

    def _route(self, item: WorkItem) -> tuple[str | None, WorkItem]:
        if item.kind == "create_adapter":
            if item.model_id in self.s.placements:
                queue, slot = self.s.placements[item.model_id]
                return queue, _with_slot(item, slot)
            queue, slot = self._allocate(item.model_id)
            if queue is None:
                return None, item
            return queue, _with_slot(item, slot)
        if item.kind in SLOT_KINDS:
            placed = self.s.placements.get(item.model_id)
            if placed is None:
                if item.kind == "free_adapter":
                    raise ApplicationError(f"{item.model_id} holds no adapter slot")
                raise ApplicationError(
                    f"training run {item.model_id} has no adapter on any worker of {self.s.base_model} "
                    "(it was released, or its JAX worker died or restarted)", type="AdapterLost")
            queue, slot = placed
            if item.kind == "snapshot":
                key = item.params["key"]
                self._collect_ephemeral_snapshots(item.model_id, newest=key)
                self.s.snapshots[key] = queue
                self.s.snapshot_used[key] = workflow.now().timestamp()
                if ":sample:" in key:
                    self.s.snapshot_runs[key] = item.model_id
            return queue, _with_slot(item, slot)
        if item.kind == "sample":
            key = item.params.get("snapshot") or ""
            if key:
                queue = self.s.snapshots.get(key)
                if queue is None and key.startswith("tinker://"):
                    # Saved sampler (or training) weights not in any worker's memory: the least busy worker loads
                    # them from storage first, in the same batch (see _loads_for).
                    queue = self._least_busy()
                    if queue is None:
                        return None, item
                if queue is None:
                    raise ApplicationError(
                        f"sampler weights {key!r} are not loaded on any worker (collected after "
                        f"{EPHEMERAL_SNAPSHOT_IDLE_S:g}s unused once a newer snapshot existed, expired, or never "
                        "saved); "
                        "save new sampler weights")
                self.s.snapshot_used[key] = workflow.now().timestamp()
                return queue, item
            return self._least_busy(), item
        if item.kind == "drop_snapshots" and "keys" in item.params:  # our own collection, for one worker's queue
            if item.params["queue"] not in self.s.workers:
                raise ApplicationError("the worker holding these snapshots is gone (and its snapshots with it)")
            return item.params["queue"], item
        if item.kind == "drop_snapshots":
            prefix = item.params["prefix"]
            holders = {q for k, q in self.s.snapshots.items() if k.startswith(prefix)}
            for k in [k for k in self.s.snapshots if k.startswith(prefix)]:
                self._forget_snapshot(k)
            if not holders:
                raise ApplicationError(f"no snapshots with prefix {prefix}")
            return sorted(holders)[0], item
        raise ApplicationError(f"unknown work kind {item.kind!r}")

    def _loads_for(self, item: WorkItem, queue: str) -> list[WorkItem]:
        """Work that must run before `item` on `queue`: loading saved weights a sample call names."""
        key = item.params.get("snapshot") or "" if item.kind == "sample" else ""
        if not key.startswith("tinker://") or self.s.snapshots.get(key) == queue:
            return []
        self.s.snapshots[key] = queue
        self.s.snapshot_used[key] = workflow.now().timestamp()
        return [WorkItem(key=f"load-{key}-{workflow.uuid4().hex[:8]}", requester=workflow.info().workflow_id,
                         kind="load_snapshot", params={"path": key})]

    def _collect_ephemeral_snapshots(self, model_id: str, newest: str) -> None:
        """Queue drops for this run's older ephemeral snapshots that nobody sampled recently."""
        now = workflow.now().timestamp()
        stale: dict[str, list[str]] = {}
        for key, run in self.s.snapshot_runs.items():
            if run == model_id and key != newest and now - self.s.snapshot_used.get(key, 0.0) > EPHEMERAL_SNAPSHOT_IDLE_S:
                stale.setdefault(self.s.snapshots[key], []).append(key)
        for queue, keys in stale.items():
            for key in keys:
                self._forget_snapshot(key)
            self.s.pending.append(WorkItem(
                key=f"gc-{keys[0]}", requester=workflow.info().workflow_id, kind="drop_snapshots",
                params={"keys": keys, "queue": queue}))

    def _forget_snapshot(self, key: str) -> None:
        self.s.snapshots.pop(key, None)
        self.s.snapshot_runs.pop(key, None)
        self.s.snapshot_used.pop(key, None)

    def _allocate(self, model_id: str) -> tuple[str | None, int]:
        if not self.s.workers:
            return None, -1
        candidates = sorted(
            (len(w.slots), q) for q, w in self.s.workers.items() if len(w.slots) < w.info.max_adapters
        )
        if not candidates:
            total = sum(w.info.max_adapters for w in self.s.workers.values())
            raise ApplicationError(
                f"no free LoRA adapter slot for base model {self.s.base_model}: all {total} are in use; "
                "finish an idle session or start the JAX worker with a larger --max-lora-adapters"
            )
        queue = candidates[0][1]
        worker = self.s.workers[queue]
        slot = next(i for i in range(worker.info.max_adapters) if str(i) not in worker.slots)
        worker.slots[str(slot)] = model_id
        self.s.placements[model_id] = [queue, slot]
        self._set_details()
        return queue, slot

    def _least_busy(self) -> str | None:
        idle = [q for q in self.s.workers if q not in self._busy]
        pool = idle or list(self.s.workers)
        return sorted(pool)[0] if pool else None

    # --- dispatch ------------------------------------------------------------------------------------------------

    async def _dispatch(self, queue: str, items: list[WorkItem]) -> None:
        self.s.dispatched_batches += 1
        incarnation = self.s.workers[queue].info.incarnation if queue in self.s.workers else ""
        try:
            result: BatchResult = await workflow.execute_activity(
                "run_batch",
                Batch(items=items, incarnation=incarnation),
                result_type=BatchResult,
                task_queue=queue,
                start_to_close_timeout=timedelta(minutes=30),
                # A worker is sent one batch at a time, when idle: a batch not picked up within this means it died.
                schedule_to_start_timeout=timedelta(seconds=30),
                # The JAX worker heartbeats every 5 s from a side thread, even inside one long engine call.
                heartbeat_timeout=timedelta(seconds=15),
                # No retries: run_batch answers engine errors itself, so an activity failure means the worker died,
                # and a retry could only reach its successor, which refuses a batch placed for its predecessor.
                retry_policy=RetryPolicy(maximum_attempts=1),
                summary=_summarise(items),
            )
            results = result.results
        except ActivityError as e:
            cause = str(getattr(e.cause, "message", e))
            lost = isinstance(e.cause, TimeoutError_) or getattr(e.cause, "type", "") == "WorkerLost"
            workflow.logger.error("batch on %s failed (%s): %s", queue, "worker lost" if lost else "error", cause)
            if lost:
                self._lose_worker(queue, incarnation)
                message = (f"the JAX worker on {queue} died or restarted while running this ({cause}); "
                           "its adapters are restored from their latest snapshot")
            else:
                message = f"the JAX worker failed this batch: {cause}"
            results = [WorkResult(key=i.key, outcome=Outcome(error=message, category="server", worker_lost=lost))
                       for i in items]
        finally:
            self._busy.discard(queue)
            self._changed = True
        by_key = {r.key: r for r in results}
        for item in items:
            r = by_key.get(item.key) or WorkResult(item.key, Outcome.failed("the JAX worker returned no result", "server"))
            self._after(item, r)
            if not r.delivered:
                self._answer(r, item.requester)

    def _lose_worker(self, queue: str, incarnation: str) -> None:
        """Forget a dead worker (unless it already came back as a new process): its adapters and snapshots went with
        it. It registers again when it restarts; the runs that lived there restore themselves (TrainingRun)."""
        worker = self.s.workers.get(queue)
        if worker is None or worker.info.incarnation != incarnation:
            return
        self._drop_worker(queue)
        self._set_details()

    def _drop_worker(self, queue: str) -> None:
        """Forget a worker with everything it held: its adapter placements and its sampler snapshots."""
        for model_id in self.s.workers.pop(queue).slots.values():
            self.s.placements.pop(model_id, None)
        for key in [k for k, q in self.s.snapshots.items() if q == queue]:
            self._forget_snapshot(key)

    def _after(self, item: WorkItem, result: WorkResult) -> None:
        """Bookkeeping that depends on how the engine answered."""
        if item.kind == "free_adapter" or (item.kind == "create_adapter" and not result.outcome.ok):
            placed = self.s.placements.pop(item.model_id, None)
            if placed is not None and placed[0] in self.s.workers:
                self.s.workers[placed[0]].slots.pop(str(placed[1]), None)
            self._set_details()
        if item.kind == "snapshot" and not result.outcome.ok:
            self.s.snapshots.pop(item.params["key"], None)
        if item.kind == "load_snapshot" and not result.outcome.ok:
            self._forget_snapshot(item.params["path"])

    def _answer(self, result: WorkResult, requester: str) -> None:
        self._signals_in_flight += 1
        asyncio.ensure_future(self._signal(requester, result))  # noqa: RUF006 (the workflow loop holds it)

    async def _signal(self, workflow_id: str, result: WorkResult) -> None:
        try:
            await workflow.get_external_workflow_handle(workflow_id).signal("deliver", result)
        except Exception as e:  # the requester may have ended (timed-out session); nobody is waiting then
            workflow.logger.info("could not deliver %s to %s: %s", result.key, workflow_id, e)
        finally:
            self._signals_in_flight -= 1

    def _set_details(self) -> None:
        used = sum(len(w.slots) for w in self.s.workers.values())
        total = sum(w.info.max_adapters for w in self.s.workers.values())
        workflow.set_current_details(
            f"{self.s.base_model} · {len(self.s.workers)} worker(s) · adapter slots {used}/{total} in use"
        )


def _with_slot(item: WorkItem, slot: int) -> WorkItem:
    return WorkItem(
        key=item.key, requester=item.requester, kind=item.kind, model_id=item.model_id, session_id=item.session_id,
        payload=item.payload, params=item.params, slot=slot,
    )


def _summarise(items: list[WorkItem]) -> str:
    counts: dict[str, int] = {}
    for i in items:
        counts[i.kind] = counts.get(i.kind, 0) + 1
    runs = len({i.model_id for i in items if i.model_id})
    parts = [f"{KIND_LABELS.get(k, k)} ×{n}" for k, n in counts.items()]
    return " · ".join(parts) + (f" · {runs} run(s)" if runs else "")
