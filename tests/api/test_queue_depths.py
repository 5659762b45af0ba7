"""QueueDepths: a burst of concurrent asample calls sends one Coordinator query, not one per call (Temporal buffers
few queries per workflow and the rest would retry with backoff, stalling the burst). Callers holding a stale depth
wait for that one fresh query, and go on with the stale depth only when it is slow; a failed query keeps the last
depth known."""

from __future__ import annotations

import asyncio

from tinkerflow.api.queue_depths import TTL_S, QueueDepths
from tinkerflow.common.metrics import QUEUE_DEPTH_QUERIES


class _Handle:
    def __init__(self, client: _FakeClient):
        self._client = client

    async def query(self, name: str) -> dict:
        assert name == "describe"
        self._client.sent += 1
        answer = await asyncio.shield(self._client.answer)
        if isinstance(answer, Exception):
            raise answer
        return answer


class _FakeClient:
    def __init__(self) -> None:
        self.sent = 0
        self.answer: asyncio.Future = asyncio.get_running_loop().create_future()

    def get_workflow_handle(self, workflow_id: str) -> _Handle:
        return _Handle(self)

    def respond(self, answer: dict | Exception) -> None:
        self.answer.set_result(answer)

    def next_answer(self) -> None:
        self.answer = asyncio.get_running_loop().create_future()


STALE_WAIT_S = 0.05


def _depths(client: _FakeClient, now: list[float]) -> QueueDepths:
    return QueueDepths(client, stale_wait_s=STALE_WAIT_S, clock=lambda: now[0])  # pyright: ignore[reportArgumentType] (a fake)


async def test_a_burst_of_callers_sends_one_query_and_all_get_its_answer() -> None:
    client, now = _FakeClient(), [0.0]
    depths = _depths(client, now)
    counted = QUEUE_DEPTH_QUERIES._value.get()
    callers = [asyncio.create_task(depths.depth("coordinator/m/default")) for _ in range(128)]
    await asyncio.sleep(0.01)
    client.respond({"pending_samples": 7, "pending_sample_tokens": 700})
    assert await asyncio.gather(*callers) == [(7, 700)] * 128
    assert client.sent == 1 and QUEUE_DEPTH_QUERIES._value.get() - counted == 1
    now[0] = TTL_S / 2  # fresh: no query at all
    assert await depths.depth("coordinator/m/default") == (7, 700) and client.sent == 1


async def test_stale_callers_wait_for_the_one_fresh_query() -> None:
    client, now = _FakeClient(), [0.0]
    depths = _depths(client, now)
    client.respond({"pending_samples": 0, "pending_sample_tokens": 0})
    assert await depths.depth("c") == (0, 0)
    client.next_answer()
    now[0] = 10 * TTL_S
    callers = [asyncio.create_task(depths.depth("c")) for _ in range(30)]
    await asyncio.sleep(0)
    client.respond({"pending_samples": 10, "pending_sample_tokens": 100})  # answered within the wait
    assert await asyncio.gather(*callers) == [(10, 100)] * 30  # the burst sees the queue it is joining: 429 works
    assert client.sent == 2


async def test_stale_callers_go_on_with_the_last_depth_while_one_slow_query_refreshes_it() -> None:
    client, now = _FakeClient(), [0.0]
    depths = _depths(client, now)
    client.respond({"pending_samples": 3, "pending_sample_tokens": 30})
    assert await depths.depth("c") == (3, 30)
    client.next_answer()  # the next query hangs (a busy Coordinator)
    now[0] = 10 * TTL_S
    stale = await asyncio.gather(*(depths.depth("c") for _ in range(50)))
    assert stale == [(3, 30)] * 50 and client.sent == 2  # waited STALE_WAIT_S at most, one query in flight
    client.respond({"pending_samples": 9, "pending_sample_tokens": 90})
    await asyncio.sleep(STALE_WAIT_S)
    assert await depths.depth("c") == (9, 90) and client.sent == 2


async def test_a_failed_query_keeps_the_last_depth_and_an_unknown_one_is_empty() -> None:
    client, now = _FakeClient(), [0.0]
    depths = _depths(client, now)
    client.respond(RuntimeError("consistent query buffer is full"))
    assert await depths.depth("c") == (0, 0)
    client.next_answer()
    client.respond({"pending_samples": 4, "pending_sample_tokens": 40})
    now[0] = 1.0
    assert await depths.depth("c") == (4, 40)
    client.next_answer()
    client.respond(RuntimeError("busy"))
    now[0] = 2.0
    assert await depths.depth("c") == (4, 40)
    assert client.sent == 3


async def test_what_was_admitted_since_the_query_was_sent_counts_until_a_later_answer() -> None:
    client, now = _FakeClient(), [0.0]
    depths = _depths(client, now)
    client.respond({"pending_samples": 1, "pending_sample_tokens": 24})

    async def call() -> bool:  # as submit_sample does: check, then count itself in, with no await between
        samples, _ = await depths.depth("c")
        if samples >= 2:  # --max-queued-samples 2
            return False
        depths.admitted("c", 1, 24)
        return True

    admitted_ok = sum(await asyncio.gather(*(call() for _ in range(30))))
    assert admitted_ok == 1 and client.sent == 1  # the rest of the burst saw the queue it filled: 429
    assert await depths.depth("c") == (2, 48)
    client.next_answer()
    client.respond({"pending_samples": 2, "pending_sample_tokens": 48})  # the Coordinator now holds that call
    now[0] = 1.0
    assert await depths.depth("c") == (2, 48)  # counted once, not twice
