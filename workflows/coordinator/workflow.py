"""Coordinator: the batching brain for one base model on one pool of JAX workers (docs/architecture.md §The workflows).

Requester workflows (training runs, sample requests, sessions) `submit` WorkItems by signal. The coordinator places
adapters on workers (slot allocation), and while a worker is busy it queues that worker's work; the moment the worker
is free it dispatches everything queued for it as ONE activity on the worker's own task queue. Under load that is
natural batching (forward/backward of many runs in one pass, many sample calls in one decode batch) at no added
latency for a lone user. A worker that takes batches in order is given its next batch while the current one runs
(dispatch.py), so it never waits for this workflow between two batches. Each requester gets its share of the batch
result back as a `deliver` signal.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, FailureError
from temporalio.exceptions import CancelledError as CancelledError_
from temporalio.exceptions import TimeoutError as TimeoutError_

from tinkerflow.workflows.coordinator.dispatch import PIPELINE_DEPTH, InFlight, Pipelines, summarise
from tinkerflow.workflows.coordinator.fairness import fair_order, growing
from tinkerflow.workflows.coordinator.paging import BatchPlan
from tinkerflow.workflows.coordinator.placement import SLOT_KINDS, PlacementPolicy
from tinkerflow.workflows.coordinator.state import CoordinatorState
from tinkerflow.workflows.coordinator.view import describe
from tinkerflow.workflows.protocol.error_types import ErrorType
from tinkerflow.workflows.protocol.messages import (
    Batch,
    BatchResult,
    DropSnapshots,
    Outcome,
    WorkerInfo,
    WorkItem,
    WorkKind,
    WorkResult,
)

MAX_BATCH_ITEMS = 64
# Under load signals keep arriving while the continue-as-new task runs, so Temporal rejects that task once and the
# worker replays the whole history, during which nothing is dispatched. A shorter history than Temporal suggests
# keeps that stall to a few seconds, at a drain every ~2,000 events (figures: docs/benchmarks.md §Measurements behind
# the code).
CONTINUE_AS_NEW_EVENTS = 2_000
# A worker that registers again under a new incarnation is a new process: the batch its predecessor was running is
# lost. Failing it then, instead of at the activity's heartbeat timeout (15 s), is what lets a killed worker's runs
# restore as soon as its successor is up. Patched: it answers an in-flight batch at a different point in history.
PATCH_FAIL_RESTARTED_BATCH = "coordinator-fail-batch-of-restarted-worker"
# Slots as a cache (paging.py): a create never fails for lack of a slot, batches page their runs in. Patched: it
# changes when creates are answered and what each batch holds.
PATCH_PAGING = "coordinator-adapter-paging-v1"
# Pipelined dispatch (dispatch.py): a worker that takes batches in order gets its next batch while one runs. Patched:
# it dispatches a batch at a point in history where none was dispatched before.
PATCH_PIPELINE = "coordinator-pipelined-dispatch-v1"
# An ephemeral snapshot no worker holds is loaded again from its copy in the store (activities/sampler_weights.py)
# rather than failing its sample. Patched: it dispatches a load where the sample was answered as an error before.
PATCH_RELOAD_EPHEMERAL = "coordinator-reload-ephemeral-snapshots-v1"
# A batch is started by its worker at once (or, pipelined, as soon as it polls beside the one it runs): one not
# picked up within this means the worker died.
SCHEDULE_TO_START = timedelta(seconds=30)
BATCH_START_TO_CLOSE = timedelta(minutes=30)


@workflow.defn(name="Coordinator")
class Coordinator:
    @workflow.init
    def __init__(self, state: CoordinatorState) -> None:
        self.s = state
        self.placement = PlacementPolicy(
            state,
            workflow.info().workflow_id,
            drop_on_every_holder=self._drops_per_holder,
            paging=lambda: workflow.patched(PATCH_PAGING),
            reload_ephemeral=lambda: workflow.patched(PATCH_RELOAD_EPHEMERAL),
        )
        self._signals_in_flight = 0  # deliveries not yet sent; continue-as-new must not drop them
        # Set by every change that can make routing succeed (work submitted, worker registered, batch finished).
        # The loop wakes only on a change: routing that finds nothing to do must not spin (a workflow that loops
        # without yielding is killed by the deadlock detector and takes the whole base model down with it).
        self._changed = True
        # Strong references to the fire-and-forget tasks (dispatches, signal deliveries) until they finish.
        self._tasks: set[asyncio.Future[None]] = set()
        # Worker queue -> its batches in flight: a worker is busy while it has one; one that takes batches in order
        # has its next one queued behind it (dispatch.py).
        self._pipelines = Pipelines()

    @workflow.run
    async def run(self, state: CoordinatorState) -> None:
        while True:
            await workflow.wait_condition(lambda: self._changed)
            self._changed = False
            if self._should_continue_as_new():
                # Drain: dispatch nothing new; once no batch is in flight, carry the queue into a fresh run.
                if self._pipelines:
                    continue
                await workflow.wait_condition(lambda: workflow.all_handlers_finished() and not self._signals_in_flight)
                workflow.continue_as_new(self.s)
            for queue in self._ready_queues():
                items = self._take_for(queue)
                if items:
                    self._start(queue, items)

    @staticmethod
    def _drops_per_holder() -> bool:
        """A session's snapshot drop reaches every worker holding its snapshots. Patched: before, one drop went to
        the first holder only, and a drop kept for a busy worker was resolved again and failed as finding nothing."""
        return workflow.patched("coordinator-drop-every-holder-v1")

    def _should_continue_as_new(self) -> bool:
        info = workflow.info()
        return info.is_continue_as_new_suggested() or info.get_current_history_length() > CONTINUE_AS_NEW_EVENTS

    # --- messages ------------------------------------------------------------------------------------------------

    @workflow.signal
    def register_worker(self, info: WorkerInfo) -> None:
        restarted = info.task_queue in self.s.workers
        if not self.placement.register(info):
            return  # the periodic re-registration of a live worker
        if restarted:
            # A restarted worker lost its in-memory adapters and snapshots: what we had placed there is forgotten, so
            # the runs that lived on it restore themselves instead of silently training a fresh adapter.
            workflow.logger.warning("worker %s re-registered; its adapters were lost", info.worker_id)
            for in_flight in self._pipelines.all_on(info.task_queue):
                if not in_flight.answered() and workflow.patched(PATCH_FAIL_RESTARTED_BATCH):
                    in_flight.cancel()  # _dispatch answers its items as worker-lost
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
        self.placement.forget_snapshot(tinker_path)
        self.s.pending.append(
            WorkItem(
                key=f"forget-{tinker_path}-{workflow.uuid4().hex[:8]}",
                requester=workflow.info().workflow_id,
                kind=WorkKind.DROP_SNAPSHOTS,
                drop=DropSnapshots(keys=[tinker_path], queue=queue),
            )
        )
        self._changed = True

    @workflow.query
    def describe(self) -> dict[str, Any]:
        return describe(self.s, self._pipelines)

    # --- routing -------------------------------------------------------------------------------------------------

    def _ready_queues(self) -> list[str]:
        if not self.s.pending:
            return []
        return [q for q in self.s.workers if self._has_room(q)]

    def _has_room(self, queue: str) -> bool:
        """Whether `queue` takes a batch now: when idle, or (pipelined) while fewer than its depth are in flight."""
        n = self._pipelines.count(queue)
        if n == 0:
            return True
        depth = min(PIPELINE_DEPTH, self.s.workers[queue].info.pipeline_depth)
        return n < depth and workflow.patched(PATCH_PIPELINE)

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
        # Slots as a cache: each item on a run's adapter gets its run made resident for this batch, or waits.
        plan = None
        if queue in self.s.workers and self.placement.pages():
            wanted = {i.model_id for i in source if i.model_id}
            plan = BatchPlan(self.s, queue, wanted=wanted, in_flight=self._pipelines.pinned(queue))
        for item in growing(pending, source, queued):
            if len(taken) >= MAX_BATCH_ITEMS:
                keep.append(item)
                continue
            try:
                target, routed = self.placement.route(item, self._pipelines.busy(), workflow.now().timestamp())
            except ApplicationError as e:
                outcome = Outcome(error=e.message, category="user", worker_lost=e.type == ErrorType.ADAPTER_LOST)
                self._answer(WorkResult(key=item.key, outcome=outcome), item.requester)
                continue
            if target is None:
                keep.append(item)  # waits for a worker to register
            elif target == queue:
                if plan is not None and (routed.kind in SLOT_KINDS or routed.kind is WorkKind.CREATE_ADAPTER):
                    admitted = plan.admit(routed)
                    if admitted is None:
                        keep.append(item)  # every slot holds a run this batch needs: the next batch
                        continue
                    routed = admitted
                taken.extend(
                    self.placement.loads_for(
                        routed, queue, workflow.now().timestamp(), lambda key: f"load-{key}-{workflow.uuid4().hex[:8]}"
                    )
                )
                taken.append(routed)
            elif _resolved_drop(item, routed) and self._drops_per_holder():
                keep.append(routed)  # routing a prefix drop forgets its keys: it must not be resolved twice
            else:
                keep.append(item)
        self.s.pending = keep
        head = plan.page_item(f"page-{workflow.uuid4().hex[:12]}", workflow.info().workflow_id) if plan else None
        if head is not None:
            taken.insert(0, head)  # the moves run first: each item then finds its run's adapter in its slot
        self._set_details()  # routing may have placed adapters
        return taken

    # --- dispatch ------------------------------------------------------------------------------------------------

    def _start(self, queue: str, items: list[WorkItem]) -> None:
        """Dispatch `items` to `queue` as one batch, behind the batches already in flight there."""
        self.s.dispatched_batches += 1
        worker = self.s.workers.get(queue)
        ordered = worker is not None and worker.info.pipeline_depth > 1
        # Named only for a worker that orders batches (the name is what a later batch waits for).
        batch_id = f"{workflow.info().run_id}-{self.s.dispatched_batches}" if ordered else ""
        after = self._pipelines.last(queue)
        entry = self._pipelines.add(queue, batch_id, items)
        self._keep(asyncio.ensure_future(self._dispatch(queue, items, entry, after)))

    async def _dispatch(self, queue: str, items: list[WorkItem], entry: InFlight, after: str) -> None:
        try:
            results = await self._run_batch(queue, items, entry, after)
        finally:
            self._pipelines.remove(queue, entry)
            self._changed = True
        by_key = {r.key: r for r in results}
        for item in items:
            r = by_key.get(item.key) or WorkResult(
                item.key, Outcome.failed("the JAX worker returned no result", "server")
            )
            self._after(item, r)
            if not r.delivered and item.kind is not WorkKind.PAGE:  # a page item is ours; _after read its answer
                self._answer(r, item.requester)

    async def _run_batch(self, queue: str, items: list[WorkItem], entry: InFlight, after: str) -> list[WorkResult]:
        """The batch's activity on the worker's queue; its answers (lost or failed ones when it did not complete)."""
        incarnation = self.s.workers[queue].info.incarnation if queue in self.s.workers else ""
        if entry.cancelled:  # its worker was lost before this task scheduled it
            return _lost(items, f"the JAX worker on {queue} died or restarted before this was sent to it")
        try:
            entry.activity = workflow.start_activity(
                "run_batch",
                Batch(items=items, incarnation=incarnation, batch_id=entry.batch_id, after=after),
                result_type=BatchResult,
                task_queue=queue,
                # Queued behind another batch, its clock runs while it waits for that one on the worker.
                start_to_close_timeout=BATCH_START_TO_CLOSE * (2 if after else 1),
                schedule_to_start_timeout=SCHEDULE_TO_START,
                # The JAX worker heartbeats every 5 s from a side thread, even inside one long engine call.
                heartbeat_timeout=timedelta(seconds=15),
                # No retries: run_batch answers engine errors itself, so an activity failure means the worker died,
                # and a retry could only reach its successor, which refuses a batch placed for its predecessor.
                retry_policy=RetryPolicy(maximum_attempts=1),
                summary=summarise(items),
            )
            result: BatchResult = await entry.activity
            return result.results
        except ActivityError as e:
            # An ActivityError's cause is a FailureError (ApplicationError, TimeoutError, ...), which has a message.
            cause = e.cause.message if isinstance(e.cause, FailureError) else str(e)
            # Cancelled: register_worker cancelled it, the worker restarted under it (its predecessor's placements are
            # already forgotten, so _lose_worker below finds nothing of the old incarnation to drop).
            lost = isinstance(e.cause, (TimeoutError_, CancelledError_)) or getattr(e.cause, "type", "") == "WorkerLost"
            workflow.logger.error("batch on %s failed (%s): %s", queue, "worker lost" if lost else "error", cause)
            if lost:
                self._lose_worker(queue, incarnation)
                for behind in self._pipelines.behind(queue, entry):  # each waits for this one: they go with it
                    behind.cancel()
                return _lost(items, f"the JAX worker on {queue} died or restarted while running this ({cause})")
            message = f"the JAX worker failed this batch: {cause}"
            return [WorkResult(key=i.key, outcome=Outcome(error=message, category="server")) for i in items]

    def _lose_worker(self, queue: str, incarnation: str) -> None:
        """Forget a dead worker (unless it already came back as a new process): its adapters and snapshots went with
        it. It registers again when it restarts; the runs that lived there restore themselves (TrainingRun)."""
        if self.placement.lose_worker(queue, incarnation):
            self._set_details()

    def _keep(self, task: asyncio.Future[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _after(self, item: WorkItem, result: WorkResult) -> None:
        failed = dict((result.outcome.json or {}).get("failed") or {}) if item.kind is WorkKind.PAGE else {}
        if item.kind is WorkKind.PAGE and (failed or not result.outcome.ok):
            why = result.outcome.error or "; ".join(f"{m}: {e}" for m, e in failed.items())
            workflow.logger.warning("paging failed, those runs restore from their snapshots: %s", why)
        if self.placement.after(item, result.outcome.ok, sorted(failed)):
            self._set_details()

    def _answer(self, result: WorkResult, requester: str) -> None:
        self._signals_in_flight += 1
        self._keep(asyncio.ensure_future(self._signal(requester, result)))

    async def _signal(self, workflow_id: str, result: WorkResult) -> None:
        try:
            await workflow.get_external_workflow_handle(workflow_id).signal("deliver", result)
        except Exception as e:  # the requester may have ended (timed-out session); nobody is waiting then
            workflow.logger.info("could not deliver %s to %s: %s", result.key, workflow_id, e)
        finally:
            self._signals_in_flight -= 1

    def _set_details(self) -> None:
        used, total = self.placement.slots_in_use()
        live = len(self.s.placements)
        runs = f" · {live} run(s) live, {live - used} paged out" if live > used else ""
        workflow.set_current_details(
            f"{self.s.base_model} · {len(self.s.workers)} worker(s) · adapter slots {used}/{total} in use{runs}"
        )


def _lost(items: list[WorkItem], why: str) -> list[WorkResult]:
    message = f"{why}; its adapters are restored from their latest snapshot"
    return [WorkResult(key=i.key, outcome=Outcome(error=message, category="server", worker_lost=True)) for i in items]


def _resolved_drop(item: WorkItem, routed: WorkItem) -> bool:
    return (
        item.kind is WorkKind.DROP_SNAPSHOTS
        and item.drop is not None
        and item.drop.keys is None
        and routed.drop is not None
        and routed.drop.keys is not None
    )
