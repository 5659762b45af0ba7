"""One Temporal result wait per sample batch workflow, shared by every future in it.

A SampleRequestWorkflow carries up to 64 `asample` calls (sample_batches.py) and returns one `list[Outcome]`.
Each call's future polls on its own, so without sharing, N calls in a batch cost N long-polls of the same history
and N decodes of the same list, all on the API's one event loop and on the Temporal server: O(calls x batch).
Here the first poll of a batch starts the one wait; later polls join it, and once it has finished its (small:
outcomes hold BlobRefs, not samples) result is kept for a while, so a poll arriving after the result costs nothing.

The shared wait is shielded: a poll that gives up (retrieve_future's long-poll timeout, a dropped connection)
leaves it running for the others. Only when nobody has waited on it for ABANDON_GRACE_S is it cancelled, so a
client that went away does not keep a long-poll open forever. Nothing here is a source of truth: losing it
(a restart, another replica) costs a fetch, never an answer. Failures are not kept: a failed workflow fails every
poll waiting at the time the same way, and a later poll fetches (and fails) again.

A result wait that has no answer after RESULT_POLL_S asks again (`workflow_result`): the history long poll under
`WorkflowHandle.result()` ends only at the server's expiry (~20 s) if it misses the close it waits for, and a deadline
on the RPC does not end it sooner (temporalio retries past it), while a fresh ask of a closed workflow answers at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from temporalio.client import Client

from tinkerflow.common.metrics import BATCH_RESULT_FETCHES, RESULT_REPOLLS
from tinkerflow.workflows.protocol.messages import Outcome

log = logging.getLogger(__name__)

MAX_FINISHED = 256  # batches whose result is kept: a full one (64 Outcomes) decodes to ~100 kB, so ≤ ~26 MB
FINISHED_TTL_S = 120.0  # SDK polls re-arrive within seconds of a result; later ones (after a restart) just re-fetch
ABANDON_GRACE_S = 10.0  # the SDK re-polls at once after try_again; a wait nobody rejoins within this is dropped
# A missed close costs at most this; a workflow still running costs one history RPC per this while it runs.
RESULT_POLL_S = 5.0


async def workflow_result(client: Client, workflow_id: str, result_type: Any, poll_s: float = RESULT_POLL_S) -> Any:
    """`WorkflowHandle.result()` of `workflow_id`, asked again every `poll_s` until it answers."""
    handle = client.get_workflow_handle(workflow_id, result_type=result_type)
    while True:
        try:
            return await asyncio.wait_for(handle.result(), poll_s)
        except TimeoutError:
            RESULT_REPOLLS.inc()


@dataclass
class _Wait:
    task: asyncio.Task[list[Outcome]]
    waiters: int = 0
    abandon: asyncio.TimerHandle | None = field(default=None, repr=False)


class BatchResults:
    """The outcomes of sample batch workflows, fetched once per workflow however many futures ask."""

    def __init__(
        self,
        client: Client,
        *,
        max_finished: int = MAX_FINISHED,
        finished_ttl_s: float = FINISHED_TTL_S,
        abandon_grace_s: float = ABANDON_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = RESULT_POLL_S,
    ):
        self._client = client
        self._max_finished = max_finished
        self._ttl_s = finished_ttl_s
        self._grace_s = abandon_grace_s
        self._clock = clock
        self._poll_s = poll_s
        self._waits: dict[str, _Wait] = {}
        self._finished: OrderedDict[str, tuple[float, list[Outcome]]] = OrderedDict()

    async def outcome(self, workflow_id: str, index: int) -> Outcome:
        """Item `index` of `workflow_id`'s result; raises what `WorkflowHandle.result()` raises (e.g.
        WorkflowFailureError for a failed workflow, RPCError NOT_FOUND for an unknown one)."""
        outcomes = self._cached(workflow_id)
        if outcomes is None:
            outcomes = await self._join(workflow_id)
        return outcomes[index]

    def _cached(self, workflow_id: str) -> list[Outcome] | None:
        now = self._clock()
        while self._finished:  # oldest first: drop what has aged out
            oldest, (at, _) = next(iter(self._finished.items()))
            if now - at <= self._ttl_s:
                break
            del self._finished[oldest]
        hit = self._finished.get(workflow_id)
        return None if hit is None else hit[1]

    async def _join(self, workflow_id: str) -> list[Outcome]:
        wait = self._waits.get(workflow_id)
        if wait is None:
            wait = self._waits[workflow_id] = _Wait(asyncio.create_task(self._fetch(workflow_id)))
            wait.task.add_done_callback(lambda task, w=wait: self._settle(workflow_id, w))
        if wait.abandon is not None:
            wait.abandon.cancel()
            wait.abandon = None
        wait.waiters += 1
        try:
            # shield: this poll timing out or being cancelled must not cancel the wait the others share.
            return await asyncio.shield(wait.task)
        finally:
            wait.waiters -= 1
            if wait.waiters == 0 and not wait.task.done():
                wait.abandon = asyncio.get_running_loop().call_later(self._grace_s, self._drop_if_idle, workflow_id)

    async def _fetch(self, workflow_id: str) -> list[Outcome]:
        BATCH_RESULT_FETCHES.inc()
        return await workflow_result(self._client, workflow_id, list[Outcome], self._poll_s)

    def _settle(self, workflow_id: str, wait: _Wait) -> None:
        """The wait ended (result, failure or cancel): forget it, and keep a result for later polls."""
        if self._waits.get(workflow_id) is wait:  # a dropped wait's end must not forget its successor
            del self._waits[workflow_id]
        if wait.abandon is not None:
            wait.abandon.cancel()
        if wait.task.cancelled():
            return
        if (error := wait.task.exception()) is not None:  # retrieved here, so an unawaited failure logs no warning
            log.debug("result of %s: %s", workflow_id, error)
            return
        self._finished[workflow_id] = (self._clock(), wait.task.result())
        self._finished.move_to_end(workflow_id)
        while len(self._finished) > self._max_finished:
            self._finished.popitem(last=False)

    def _drop_if_idle(self, workflow_id: str) -> None:
        wait = self._waits.get(workflow_id)
        if wait is not None and wait.waiters == 0 and not wait.task.done():
            log.debug("nobody polls %s any more: dropping its result wait", workflow_id)
            del self._waits[workflow_id]
            wait.task.cancel()

    @property
    def in_flight(self) -> int:
        return len(self._waits)

    @property
    def finished(self) -> int:
        return len(self._finished)
