"""Which runs' adapters are resident in a worker's training slots while it runs a batch: slots as a cache.

A worker has `max_adapters` training slots and can keep `max_paged` more adapters paged out (host memory, then
files: the engine's page store). Every live run has one home worker (`CoordinatorState.placements`: model_id ->
[queue, slot], slot -1 while paged out). Work on a run's adapter runs only while the adapter is resident, so the
Coordinator forms each batch from resident adapters: `BatchPlan.admit` gives each item of the batch it is building
its run's slot, paging the run in when it is out, into a free slot or one it frees by paging out the least recently
used resident run that has nothing in this batch (runs with work waiting in the queue go last). An op in flight is
never paged out: a run is in flight when it has an item in the batch being built or in a batch the worker has not
answered yet (the one running while the next is formed and queued behind it: dispatch.py), and those are pinned.
An item that finds every slot pinned waits for the next batch, and so do its run's later items; the moves go to the
worker as one `page` item at the batch's head, which the worker runs after every batch before it.

What the capacity allows is decided at create (`home_for`): a run is refused only when every worker holds all the
adapters its slots and page budgets allow, or when its owner already holds `TenantLimit.max_live_runs` live runs on
this base model. Pure and deterministic, like placement.py (tests/workflows/test_paging_plan.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Set as AbstractSet
from dataclasses import replace

from temporalio.exceptions import ApplicationError

from tinkerflow.workflows.coordinator.state import CoordinatorState
from tinkerflow.workflows.protocol.messages import PageMoves, SlotMove, WorkItem, WorkKind


def live_per_worker(state: CoordinatorState) -> Counter[str]:
    return Counter(queue for queue, _ in state.placements.values())


def home_for(state: CoordinatorState, item: WorkItem) -> str | None:
    """The worker a new run's adapter lives on: the one with the fewest live runs among those with room (ties: by
    queue name); None while no worker exists. ApplicationError (answered as a user error) past the owner's limit
    or when no worker has room."""
    tenant = item.tenant
    if tenant is not None and tenant.max_live_runs > 0 and item.model_id not in state.owners:
        held = sum(1 for owner in state.owners.values() if owner == tenant.owner)
        if held >= tenant.max_live_runs:
            raise ApplicationError(
                f"this API key already holds {held} live training runs on base model {state.base_model}, the most "
                f"one tenant may (the server's --max-live-runs-per-tenant {tenant.max_live_runs}); end the sessions "
                "of runs you no longer train (or let them time out) before creating another"
            )
    if not state.workers:
        return None
    live = live_per_worker(state)
    room = sorted(
        (live[q], q) for q, w in state.workers.items() if live[q] < w.info.max_adapters + max(0, w.info.max_paged)
    )
    if room:
        return room[0][1]
    slots = sum(w.info.max_adapters for w in state.workers.values())
    paged = sum(max(0, w.info.max_paged) for w in state.workers.values())
    if not paged:
        raise ApplicationError(
            f"no free LoRA adapter slot for base model {state.base_model}: all {slots} are in use and its JAX "
            "workers page no adapters out (--adapter-host-memory-mb and --adapter-disk-mb too small for one); "
            "finish an idle session, or give the JAX workers page budgets or a larger --max-lora-adapters"
        )
    raise ApplicationError(
        f"no room for another LoRA adapter on base model {state.base_model}: its JAX workers hold "
        f"{sum(live.values())} live training runs, all that their {slots} device slots and page budgets for "
        f"{paged} more allow (--max-lora-adapters, --adapter-host-memory-mb, --adapter-disk-mb); finish an idle "
        "session, or give the JAX workers larger budgets"
    )


class BatchPlan:
    """The paging one batch on worker `queue` needs (see the module doc); `admit` each item in batch order."""

    def __init__(
        self,
        state: CoordinatorState,
        queue: str,
        wanted: AbstractSet[str] = frozenset(),
        in_flight: AbstractSet[str] = frozenset(),
    ):
        self.s = state
        self.queue = queue
        # Runs with work waiting anywhere in the queue: paged out only when no other run can make room (each would
        # be paged back in soon, perhaps later in this very batch).
        self.wanted = wanted
        # Runs with an item in this batch, or in a batch still in flight on this worker (the one running while this
        # one is formed to queue behind it: dispatch.py): never paged out by it.
        self.pinned: set[str] = set(in_flight)
        self.blocked: set[str] = set()  # runs whose item waits for a slot: their later items wait too
        self.page_out: list[SlotMove] = []
        self.page_in: list[SlotMove] = []
        self.drop: list[str] = []

    def admit(self, item: WorkItem) -> WorkItem | None:
        """`item` (already routed to this queue) with its run's slot, the run made resident first where needed;
        None when it must wait for a later batch."""
        model = item.model_id
        if model in self.blocked:
            return None
        placed = self.s.placements.get(model)
        if item.kind is WorkKind.FREE_ADAPTER and (placed is None or placed[1] < 0):
            return replace(item, slot=-1)  # a paged-out run ends: its page is dropped, no slot needed
        if placed is not None and placed[1] >= 0:
            self._use(model)
            return replace(item, slot=placed[1])
        slot = self._free_slot()
        if slot is None:
            self.blocked.add(model)
            return None
        if placed is not None:  # paged out on this worker
            if item.kind is WorkKind.CREATE_ADAPTER:
                self.drop.append(model)  # created again from scratch: its old page is stale
            else:
                self.page_in.append(SlotMove(model, slot))
                self.s.page_ins += 1
        if item.kind is WorkKind.CREATE_ADAPTER and item.tenant is not None:
            self.s.owners[model] = item.tenant.owner
        self.s.workers[self.queue].slots[str(slot)] = model
        self.s.placements[model] = [self.queue, slot]
        self._use(model)
        return replace(item, slot=slot)

    def _use(self, model: str) -> None:
        self.pinned.add(model)
        self.s.lru_tick += 1
        self.s.lru[model] = self.s.lru_tick

    def _free_slot(self) -> int | None:
        """The lowest free slot, else one freed by paging out the least recently used unpinned resident run (never
        on a worker that does not page); None when every slot is pinned."""
        worker = self.s.workers[self.queue]
        free = next((i for i in range(worker.info.max_adapters) if str(i) not in worker.slots), None)
        if free is not None:
            return free
        if worker.info.max_paged <= 0:
            return None
        victims = [
            (m in self.wanted, self.s.lru.get(m, 0), int(s), m) for s, m in worker.slots.items() if m not in self.pinned
        ]
        if not victims:
            return None
        *_, slot, victim = min(victims)
        del worker.slots[str(slot)]
        self.s.placements[victim] = [self.queue, -1]
        self.page_out.append(SlotMove(victim, slot))
        self.s.page_outs += 1
        return slot

    def page_item(self, key: str, requester: str) -> WorkItem | None:
        """The batch's head: its page moves as one item (None when it needs none)."""
        if not (self.page_out or self.page_in or self.drop):
            return None
        moves = PageMoves(page_out=list(self.page_out), page_in=list(self.page_in), drop=list(self.drop))
        return WorkItem(key=key, requester=requester, kind=WorkKind.PAGE, page=moves)


def lost_in_paging(item: WorkItem, ok: bool, failed: list[str]) -> list[str]:
    """The runs a page item left without an adapter on its worker: those the worker names, or all it moved when
    the item failed as a whole (their runs restore themselves from their snapshots)."""
    moves = item.page or PageMoves()
    if ok:
        return list(failed)
    return [m.model_id for m in moves.page_out] + [m.model_id for m in moves.page_in]
