"""How much sampling work waits in each Coordinator's queue, as asample's 429 check reads it: one query at a time.

The depth comes from the Coordinator's `describe` query. A query is answered in the Coordinator's next workflow
task, and Temporal buffers very few of them per workflow (`history.MaxBufferedQueryCount`): under a burst of
concurrent asample calls, each stale-cache caller sending its own query overflowed that buffer, and the rejected
ones retried with the client's backoff, holding their calls for seconds (O(calls) queries, a stall per burst).
Here concurrent callers share one in-flight query and wait for its answer (one round trip, a few ms); what this
process admitted since that query was sent is added to its answer, so a burst answered by one query still sees
itself fill the queue and its tail gets 429, as when each call queried on its own. The estimate errs high (work
admitted and already picked up counts until the next refresh): the limit is a back-pressure bound, not a count.
Only when that one query is slow (a Coordinator too busy to answer) does a caller holding a stale depth go on with
it after STALE_WAIT_S, instead of holding its call for the client's retry backoff.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from temporalio.client import Client

from tinkerflow.common.metrics import QUEUE_DEPTH_QUERIES, SAMPLING_QUEUE

log = logging.getLogger(__name__)

TTL_S = 0.25  # a depth younger than this is used as is
STALE_WAIT_S = 1.0  # how long a caller holding a stale depth waits for the fresh one before using the stale one
FIRST_WAIT_S = 5.0  # how long the first caller (no depth known yet) waits before assuming an empty queue


@dataclass
class _Depth:
    answered_at: float = float("-inf")
    answer: tuple[int, int] = (0, 0)  # (samples, tokens) the last query answered
    admitted_at_send: tuple[int, int] = (0, 0)  # `admitted` when that query was sent
    admitted: tuple[int, int] = (0, 0)  # (samples, tokens) this process admitted, all told
    refreshing: asyncio.Task[None] | None = field(default=None, repr=False)

    def estimate(self) -> tuple[int, int]:
        return (
            self.answer[0] + self.admitted[0] - self.admitted_at_send[0],
            self.answer[1] + self.admitted[1] - self.admitted_at_send[1],
        )


class QueueDepths:
    def __init__(
        self, client: Client, *, stale_wait_s: float = STALE_WAIT_S, clock: Callable[[], float] = time.monotonic
    ):
        self._client = client
        self._stale_wait_s = stale_wait_s
        self._clock = clock
        self._depths: dict[str, _Depth] = {}

    async def depth(self, coordinator_id: str) -> tuple[int, int]:
        """(samples, tokens of work) waiting in `coordinator_id`'s queue: the last answer, at most about TTL_S old,
        plus what this process admitted since it was asked."""
        d = self._depths.setdefault(coordinator_id, _Depth())
        if self._clock() - d.answered_at <= TTL_S:
            return d.estimate()
        first = d.answered_at == float("-inf")
        if d.refreshing is None:
            d.refreshing = asyncio.create_task(self._query(coordinator_id, d))
        try:
            # shielded: a caller that stops waiting leaves the query to finish for the next ones
            await asyncio.wait_for(asyncio.shield(d.refreshing), FIRST_WAIT_S if first else self._stale_wait_s)
        except TimeoutError:
            pass  # go on with what is known (nothing yet: an empty queue)
        return d.estimate()

    def admitted(self, coordinator_id: str, samples: int, tokens: int) -> None:
        """A call passed the check with this much work: count it until a query answered after it."""
        d = self._depths.setdefault(coordinator_id, _Depth())
        d.admitted = (d.admitted[0] + samples, d.admitted[1] + tokens)

    async def _query(self, coordinator_id: str, d: _Depth) -> None:
        QUEUE_DEPTH_QUERIES.inc()
        sent_at = d.admitted
        try:
            described = await self._client.get_workflow_handle(coordinator_id).query("describe")
            d.answer = (int(described.get("pending_samples", 0)), int(described.get("pending_sample_tokens", 0)))
            d.admitted_at_send = sent_at
        except Exception as e:  # no answer (a busy coordinator): keep the last depth known, else accept the work
            log.debug("queue depth of %s unknown: %s", coordinator_id, e)
        finally:
            d.answered_at, d.refreshing = self._clock(), None
        SAMPLING_QUEUE.labels(coordinator_id.split("/", 1)[-1].rsplit("/", 1)[0]).set(d.answer[0])
