"""The Coordinator's placement policy, apart from Temporal: which worker and slot an adapter goes to, where each
kind of work is routed, which sampler snapshots are collected, and what a dead worker takes with it.

Pure and deterministic (stdlib, plus temporalio's ApplicationError for answers a requester reads): every decision
depends only on the CoordinatorState, the set of busy workers and the `now` the caller passes (the Coordinator
passes `workflow.now()`). The Coordinator's state is the one record of placements and snapshots; the JAX worker keeps
none of its own. Tested without a server in tests/workflows/test_placement.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import replace

from temporalio.exceptions import ApplicationError

from tinkerflow.workflows.coordinator.paging import home_for, lost_in_paging
from tinkerflow.workflows.coordinator.state import CoordinatorState, WorkerSlots
from tinkerflow.workflows.protocol.error_types import ErrorType
from tinkerflow.workflows.protocol.messages import DropSnapshots, LoadCheckpoint, WorkerInfo, WorkItem, WorkKind

# An ephemeral sampler snapshot (save_weights_and_get_sampling_client) is collected once a newer one of the same run
# exists and it has not been sampled for this long: RL loops make one per step, and none is reused for long.
EPHEMERAL_SNAPSHOT_IDLE_S = 120.0
# Work on a run's adapter: routed to the worker (and slot) holding it.
SLOT_KINDS = frozenset(
    {
        WorkKind.FORWARD_BACKWARD,
        WorkKind.OPTIM_STEP,
        WorkKind.SNAPSHOT,
        WorkKind.FREE_ADAPTER,
        WorkKind.SAVE_CHECKPOINT,
        WorkKind.LOAD_CHECKPOINT,
    }
)


class PlacementPolicy:
    """The policy over one Coordinator's state. `self_id` is the Coordinator's workflow id: housekeeping work it
    queues for itself (snapshot collection) is answered to it. `drop_on_every_holder` is asked (only when a session's
    snapshots sit on several workers) whether each holder gets its drop; the Coordinator answers with a
    `workflow.patched`, since histories from before sent one drop, to the first holder, and leaked the others."""

    def __init__(
        self,
        state: CoordinatorState,
        self_id: str,
        drop_on_every_holder: Callable[[], bool] = lambda: True,
        paging: Callable[[], bool] = lambda: True,
        reload_ephemeral: Callable[[], bool] = lambda: True,
    ) -> None:
        self.s = state
        self.self_id = self_id
        self.drop_on_every_holder = drop_on_every_holder
        # Slots as a cache (paging.py). The Coordinator answers with a `workflow.patched`: histories from before
        # allocated a slot at create and refused a create when every slot was taken.
        self.paging = paging
        # An ephemeral snapshot no worker holds (its worker died, or it was collected from memory) is loaded again
        # from the copy its snapshot op wrote (activities/sampler_weights.py) instead of failing its sample. The
        # Coordinator answers with a `workflow.patched`: histories from before answered such a sample as an error.
        self.reload_ephemeral = reload_ephemeral

    # --- adapters ------------------------------------------------------------------------------------------------

    def allocate(self, model_id: str) -> tuple[str | None, int]:
        """A slot for a new adapter: on the worker with the fewest adapters (ties: by queue name), lowest free slot.
        (None, -1) while no worker exists; an ApplicationError when every slot is taken."""
        if not self.s.workers:
            return None, -1
        candidates = sorted((len(w.slots), q) for q, w in self.s.workers.items() if len(w.slots) < w.info.max_adapters)
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
        return queue, slot

    def release(self, model_id: str) -> None:
        placed = self.s.placements.pop(model_id, None)
        if placed is not None and placed[0] in self.s.workers and placed[1] >= 0:
            self.s.workers[placed[0]].slots.pop(str(placed[1]), None)
        self.s.lru.pop(model_id, None)
        self.s.owners.pop(model_id, None)

    def register(self, info: WorkerInfo) -> bool:
        """A worker (re-)registers; True when it is a new process (a restart lost what its predecessor held)."""
        previous = self.s.workers.get(info.task_queue)
        if previous is not None and previous.info.incarnation == info.incarnation:
            return False  # the periodic re-registration of a live worker
        if previous is not None:
            self.drop_worker(info.task_queue)
        self.s.workers[info.task_queue] = WorkerSlots(info=info)
        return True

    def lose_worker(self, queue: str, incarnation: str) -> bool:
        """Forget a dead worker unless it already came back as a new process; True when it was forgotten."""
        worker = self.s.workers.get(queue)
        if worker is None or worker.info.incarnation != incarnation:
            return False
        self.drop_worker(queue)
        return True

    def drop_worker(self, queue: str) -> None:
        """Forget a worker with everything it held: its adapter placements (resident and paged out) and its sampler
        snapshots. Its runs stay live (their owners counted): they restore themselves elsewhere."""
        self.s.workers.pop(queue)
        for model_id in [m for m, (q, _) in self.s.placements.items() if q == queue]:
            self.s.placements.pop(model_id, None)
        for key in [k for k, q in self.s.snapshots.items() if q == queue]:
            self.forget_snapshot(key)

    def least_busy(self, busy: AbstractSet[str]) -> str | None:
        idle = [q for q in self.s.workers if q not in busy]
        pool = idle or list(self.s.workers)
        return sorted(pool)[0] if pool else None

    def slots_in_use(self) -> tuple[int, int]:
        used = sum(len(w.slots) for w in self.s.workers.values())
        return used, sum(w.info.max_adapters for w in self.s.workers.values())

    def pages(self) -> bool:
        """Whether this Coordinator treats slots as a cache (see `paging`); asked only once a worker can page."""
        return any(w.info.max_paged > 0 for w in self.s.workers.values()) and self.paging()

    # --- routing -------------------------------------------------------------------------------------------------

    def route(self, item: WorkItem, busy: AbstractSet[str], now: float) -> tuple[str | None, WorkItem]:
        """The worker queue `item` runs on (None: wait for a worker) and the item as dispatched (slot filled in).
        An ApplicationError answers the item now (type AdapterLost: its run may restore itself)."""
        if item.kind is WorkKind.CREATE_ADAPTER:
            if item.model_id in self.s.placements:
                queue, slot = self.s.placements[item.model_id]
                return queue, replace(item, slot=slot)
            if self.pages():  # the slot is given when the batch is formed (paging.BatchPlan)
                home = home_for(self.s, item)
                return home, item
            queue, slot = self.allocate(item.model_id)
            return (None, item) if queue is None else (queue, replace(item, slot=slot))
        if item.kind in SLOT_KINDS:
            placed = self.s.placements.get(item.model_id)
            if placed is None:
                if item.kind is WorkKind.FREE_ADAPTER:
                    self.s.owners.pop(item.model_id, None)  # its worker died: the run ends all the same
                    self.s.lru.pop(item.model_id, None)
                    raise ApplicationError(f"{item.model_id} holds no adapter slot")
                raise ApplicationError(
                    f"training run {item.model_id} has no adapter on any worker of {self.s.base_model} "
                    "(it was released, or its JAX worker died or restarted)",
                    type=ErrorType.ADAPTER_LOST,
                )
            queue, slot = placed
            if item.kind is WorkKind.SNAPSHOT:
                self._record_snapshot(item.model_id, item.snapshot, queue, now)
            return queue, replace(item, slot=slot)
        if item.kind is WorkKind.SAMPLE:
            return self._route_sample(item, busy, now)
        if item.kind is WorkKind.DROP_SNAPSHOTS:
            return self._route_drop(item)
        raise ApplicationError(f"unknown work kind {item.kind!r}")

    def _record_snapshot(self, model_id: str, key: str, queue: str, now: float) -> None:
        self.collect_ephemeral_snapshots(model_id, newest=key, now=now)
        self.s.snapshots[key] = queue
        self.s.snapshot_used[key] = now
        if ":sample:" in key:
            self.s.snapshot_runs[key] = model_id

    def _route_sample(self, item: WorkItem, busy: AbstractSet[str], now: float) -> tuple[str | None, WorkItem]:
        key = item.snapshot
        if not key:
            return self.least_busy(busy), item
        queue = self.s.snapshots.get(key)
        if queue is None and self._reloadable(key):
            # Sampler weights not in any worker's memory: the least busy worker loads them from storage first, in
            # the same batch (see loads_for).
            queue = self.least_busy(busy)
            if queue is None:
                return None, item
        if queue is None:
            raise ApplicationError(
                f"sampler weights {key!r} are not loaded on any worker (collected after "
                f"{EPHEMERAL_SNAPSHOT_IDLE_S:g}s unused once a newer snapshot existed, expired, or never saved); "
                "save new sampler weights"
            )
        self.s.snapshot_used[key] = now
        return queue, item

    def _route_drop(self, item: WorkItem) -> tuple[str | None, WorkItem]:
        drop = item.drop or DropSnapshots()
        if drop.keys is not None:  # our own collection, for one worker's queue
            if drop.queue not in self.s.workers:
                raise ApplicationError("the worker holding these snapshots is gone (and its snapshots with it)")
            return drop.queue, item
        # A session's prefix: resolved here into the keys this record holds, so the worker needs no record of its own.
        matching = {k: q for k, q in self.s.snapshots.items() if k.startswith(drop.prefix)}
        for k in matching:
            self.forget_snapshot(k)
        if not matching:
            raise ApplicationError(f"no snapshots with prefix {drop.prefix}")
        first, *others = sorted(set(matching.values()))
        if others and self.drop_on_every_holder():
            for queue in others:  # routed as our own collection once this item is taken
                keys = sorted(k for k, q in matching.items() if q == queue)
                self.s.pending.append(
                    WorkItem(
                        key=f"{item.key}@{queue}",
                        requester=self.self_id,
                        kind=WorkKind.DROP_SNAPSHOTS,
                        drop=DropSnapshots(keys=keys, queue=queue),
                    )
                )
        keys = sorted(k for k, q in matching.items() if q == first)
        return first, replace(item, drop=DropSnapshots(keys=keys, queue=first, prefix=drop.prefix))

    def _reloadable(self, key: str) -> bool:
        """Whether sampler weights no worker holds can be loaded from storage: saved ones always, an ephemeral
        snapshot from its copy (see `reload_ephemeral`)."""
        return key.startswith("tinker://") or self.reload_ephemeral()

    def loads_for(self, item: WorkItem, queue: str, now: float, new_key: Callable[[str], str]) -> list[WorkItem]:
        """Work that must run before `item` on `queue`: loading sampler weights a sample call names that `queue` does
        not hold (saved ones by path, an ephemeral snapshot by its key). `new_key(path)` names the load item (the
        Coordinator draws it from workflow.uuid4)."""
        key = item.snapshot if item.kind is WorkKind.SAMPLE else ""
        if not key or self.s.snapshots.get(key) == queue or not self._reloadable(key):
            return []
        self.s.snapshots[key] = queue
        self.s.snapshot_used[key] = now
        return [
            WorkItem(
                key=new_key(key), requester=self.self_id, kind=WorkKind.LOAD_SNAPSHOT, load=LoadCheckpoint(path=key)
            )
        ]

    def after(self, item: WorkItem, ok: bool, lost: Sequence[str] = ()) -> bool:
        """Bookkeeping that depends on how the engine answered (`lost`: the runs a page item names as failed);
        True when adapter slots changed."""
        if item.kind is WorkKind.FREE_ADAPTER or (item.kind is WorkKind.CREATE_ADAPTER and not ok):
            self.release(item.model_id)
            return True
        if item.kind is WorkKind.PAGE:
            return self._forget_adapters(lost_in_paging(item, ok, list(lost)))
        if item.kind is WorkKind.SNAPSHOT and not ok:
            self.s.snapshots.pop(item.snapshot, None)
        if item.kind is WorkKind.LOAD_SNAPSHOT and not ok and item.load is not None:
            self.forget_snapshot(item.load.path)
        return False

    def _forget_adapters(self, models: list[str]) -> bool:
        """Runs whose adapter a worker lost (a page move failed): no longer placed, so their next op restores them
        from their snapshot (AdapterLost) while they stay live."""
        for model_id in models:
            placed = self.s.placements.pop(model_id, None)
            if placed is not None and placed[1] >= 0 and placed[0] in self.s.workers:
                slots = self.s.workers[placed[0]].slots
                if slots.get(str(placed[1])) == model_id:
                    del slots[str(placed[1])]
        return bool(models)

    # --- sampler snapshots ---------------------------------------------------------------------------------------

    def collect_ephemeral_snapshots(self, model_id: str, newest: str, now: float) -> None:
        """Queue drops for this run's older ephemeral snapshots that nobody sampled recently."""
        stale: dict[str, list[str]] = {}
        for key, run in self.s.snapshot_runs.items():
            idle = now - self.s.snapshot_used.get(key, 0.0)
            if run == model_id and key != newest and idle > EPHEMERAL_SNAPSHOT_IDLE_S:
                stale.setdefault(self.s.snapshots[key], []).append(key)
        for queue, keys in stale.items():
            for key in keys:
                self.forget_snapshot(key)
            self.s.pending.append(
                WorkItem(
                    key=f"gc-{keys[0]}",
                    requester=self.self_id,
                    kind=WorkKind.DROP_SNAPSHOTS,
                    drop=DropSnapshots(keys=keys, queue=queue),
                )
            )

    def forget_snapshot(self, key: str) -> None:
        self.s.snapshots.pop(key, None)
        self.s.snapshot_runs.pop(key, None)
        self.s.snapshot_used.pop(key, None)
