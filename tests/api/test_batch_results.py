"""BatchResults: however many futures of one sample batch poll, and however often, the batch's result is fetched
from Temporal once (counted on a fake client); a poll that gives up does not cancel the others' wait; a failure
reaches every waiter; the kept results are bounded by count and age; a wait that missed the close is asked again.
The real stack is in tests/e2e/test_sample_batch_results.py."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import WorkflowFailureError
from temporalio.exceptions import ApplicationError

from tinkerflow.api.batch_results import BatchResults
from tinkerflow.common.metrics import BATCH_RESULT_FETCHES, RESULT_REPOLLS
from tinkerflow.workflows.protocol.messages import Outcome


class _Handle:
    def __init__(self, client: _FakeClient, workflow_id: str):
        self._client, self._id = client, workflow_id

    async def result(self) -> list[Outcome]:
        self._client.fetches[self._id] = self._client.fetches.get(self._id, 0) + 1
        try:
            return await asyncio.shield(self._client.done[self._id])  # one answer for every fetch of the batch
        except asyncio.CancelledError:
            self._client.cancelled.append(self._id)
            raise


class _FakeClient:
    """What BatchResults uses of temporalio's Client: get_workflow_handle(...).result(), resolved by the test."""

    def __init__(self) -> None:
        self.fetches: dict[str, int] = {}
        self.cancelled: list[str] = []
        self.done: dict[str, asyncio.Future[list[Outcome]]] = {}

    def get_workflow_handle(self, workflow_id: str, *, result_type=None) -> _Handle:
        self.done.setdefault(workflow_id, asyncio.get_running_loop().create_future())
        return _Handle(self, workflow_id)

    def finish(self, workflow_id: str, n: int) -> None:
        self.done[workflow_id].set_result([Outcome(json={"item": i, "batch": workflow_id}) for i in range(n)])


def _results(client: _FakeClient, **kw) -> BatchResults:
    return BatchResults(client, **kw)  # pyright: ignore[reportArgumentType] (a fake of the one method used)


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_every_concurrent_and_later_poll_of_a_batch_costs_one_fetch() -> None:
    client = _FakeClient()
    results = _results(client)
    counted = BATCH_RESULT_FETCHES._value.get()
    polls = [asyncio.create_task(results.outcome("sample/s/a", i % 64)) for i in range(200)]
    await _settle()
    assert client.fetches == {"sample/s/a": 1} and results.in_flight == 1
    client.finish("sample/s/a", 64)
    got = await asyncio.gather(*polls)
    assert [o.json for o in got] == [{"item": i % 64, "batch": "sample/s/a"} for i in range(200)]
    # later polls (the SDK's re-polls, a second retrieve of the same id) are answered from the kept result
    assert (await results.outcome("sample/s/a", 5)).json == {"item": 5, "batch": "sample/s/a"}
    assert client.fetches == {"sample/s/a": 1} and results.in_flight == 0 and results.finished == 1
    assert BATCH_RESULT_FETCHES._value.get() - counted == 1


async def test_batches_are_fetched_apart_and_each_poll_gets_its_own_batch() -> None:
    client = _FakeClient()
    results = _results(client)
    polls = {(wf, i): asyncio.create_task(results.outcome(wf, i)) for wf in ("b/1", "b/2", "b/3") for i in range(4)}
    await _settle()
    for wf in ("b/2", "b/1", "b/3"):
        client.finish(wf, 4)
    for (wf, i), poll in polls.items():
        assert (await poll).json == {"item": i, "batch": wf}
    assert client.fetches == {"b/1": 1, "b/2": 1, "b/3": 1}


async def test_a_poll_that_times_out_leaves_the_shared_wait_to_the_others() -> None:
    client = _FakeClient()
    results = _results(client)
    patient = asyncio.create_task(results.outcome("b/x", 1))
    with pytest.raises(TimeoutError):  # what retrieve_future does at long_poll_s, then answers try_again
        await asyncio.wait_for(results.outcome("b/x", 0), timeout=0.01)
    assert not client.cancelled and results.in_flight == 1
    rejoined = asyncio.create_task(results.outcome("b/x", 0))  # the SDK's re-poll joins the same wait
    await _settle()
    client.finish("b/x", 2)
    assert (await patient).json == {"item": 1, "batch": "b/x"}
    assert (await rejoined).json == {"item": 0, "batch": "b/x"}
    assert client.fetches == {"b/x": 1}


async def test_a_wait_nobody_polls_any_more_is_dropped_after_the_grace() -> None:
    client = _FakeClient()
    results = _results(client, abandon_grace_s=0.05)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(results.outcome("b/gone", 0), timeout=0.01)
    await asyncio.sleep(0.2)
    assert client.cancelled == ["b/gone"] and results.in_flight == 0
    # a poll after that starts a new wait, and it answers
    poll = asyncio.create_task(results.outcome("b/gone", 0))
    await _settle()
    client.finish("b/gone", 1)
    assert (await poll).json == {"item": 0, "batch": "b/gone"}
    assert client.fetches == {"b/gone": 2}


async def test_a_failed_batch_fails_every_waiter_alike_and_is_not_kept() -> None:
    client = _FakeClient()
    results = _results(client)
    polls = [asyncio.create_task(results.outcome("b/bad", i)) for i in range(8)]
    await _settle()
    failure = WorkflowFailureError(cause=ApplicationError("worker lost", non_retryable=True))
    client.done["b/bad"].set_exception(failure)
    outcomes = await asyncio.gather(*polls, return_exceptions=True)
    assert all(o is failure for o in outcomes)
    assert client.fetches == {"b/bad": 1} and results.finished == 0 and results.in_flight == 0
    with pytest.raises(WorkflowFailureError):  # a later poll asks Temporal again and fails the same way
        await results.outcome("b/bad", 0)
    assert client.fetches == {"b/bad": 2}


async def test_kept_results_are_bounded_by_count_and_by_age() -> None:
    now = [0.0]
    client = _FakeClient()
    results = _results(client, max_finished=3, finished_ttl_s=10.0, clock=lambda: now[0])
    for k in range(5):
        wf = f"b/{k}"
        poll = asyncio.create_task(results.outcome(wf, 0))
        await _settle()
        client.finish(wf, 1)
        await poll
    assert results.finished == 3  # the two oldest went
    await results.outcome("b/4", 0)
    await results.outcome("b/2", 0)
    assert client.fetches == {f"b/{k}": 1 for k in range(5)}
    now[0] = 11.0  # all aged out: the next poll fetches again
    assert (await results.outcome("b/4", 0)).json == {"item": 0, "batch": "b/4"}
    assert client.fetches["b/4"] == 2 and results.finished == 1


class _MissedClose(_FakeClient):
    """Each workflow's first result wait never answers (a history long poll that missed the close it waits for);
    asked again, it answers at once."""

    def get_workflow_handle(self, workflow_id: str, *, result_type=None) -> _Handle:
        handle = super().get_workflow_handle(workflow_id, result_type=result_type)
        answer = handle.result

        async def result() -> list[Outcome]:
            if self.fetches.get(workflow_id, 0) == 0:
                self.fetches[workflow_id] = 1
                await asyncio.Event().wait()  # cancelled by the re-ask
            return await answer()

        handle.result = result  # pyright: ignore[reportAttributeAccessIssue]
        return handle


async def test_a_result_wait_that_missed_the_close_is_asked_again() -> None:
    client = _MissedClose()
    results = _results(client, poll_s=0.05)
    repolls, fetches = RESULT_REPOLLS._value.get(), BATCH_RESULT_FETCHES._value.get()
    poll = asyncio.create_task(results.outcome("b/late", 1))
    await _settle()
    client.finish("b/late", 2)  # closed, while the first long poll still waits
    got = await asyncio.wait_for(poll, 5)
    assert got.json == {"item": 1, "batch": "b/late"}
    assert client.fetches == {"b/late": 2}  # the missed one and the one that answered
    assert RESULT_REPOLLS._value.get() - repolls == 1
    assert BATCH_RESULT_FETCHES._value.get() - fetches == 1  # still one shared wait for the batch
