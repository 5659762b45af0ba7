"""The JAX worker's side of pipelined dispatch: batches run one at a time in the order the Coordinator dispatched
them, whatever order they arrive in (activities/batch_order.py), and each answer goes home on one road (the
requester's signal; the Coordinator reads only whether it failed, or the whole answer when the signal failed)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any, cast

import pytest
from temporalio.exceptions import CancelledError
from temporalio.testing import ActivityEnvironment

from tinkerflow.activities.batch_order import BatchCancelled, BatchOrder
from tinkerflow.activities.engine_activities import EngineActivities
from tinkerflow.workers.engine.interface import EngineApi
from tinkerflow.workflows.protocol.messages import Batch, DropSnapshots, WorkItem, WorkResult
from tinkerflow.workflows.protocol.work import WorkKind

pytestmark = pytest.mark.timeout(30)


def test_a_batch_that_arrives_first_waits_for_the_one_it_follows() -> None:
    order = BatchOrder()
    ran: list[str] = []
    second_waiting = threading.Event()

    def second() -> None:
        second_waiting.set()
        with order.turn("b2", after="b1", cancelled=lambda: False):
            ran.append("b2")

    thread = threading.Thread(target=second)
    thread.start()
    second_waiting.wait()
    time.sleep(0.3)  # it would have run by now were it not waiting
    assert ran == []
    with order.turn("b1", after="", cancelled=lambda: False):
        ran.append("b1")
    thread.join(5)
    assert ran == ["b1", "b2"]


def test_batches_never_overlap_and_a_cancelled_waiter_leaves() -> None:
    order = BatchOrder()
    inside = threading.Event()
    leave = threading.Event()

    def first() -> None:
        with order.turn("b1", after="", cancelled=lambda: False):
            inside.set()
            leave.wait(5)

    thread = threading.Thread(target=first)
    thread.start()
    inside.wait()
    cancelled = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # Named after nothing, it still waits for the running batch; cancelled, it leaves without running.
        waiter = pool.submit(lambda: order.turn("b2", after="", cancelled=cancelled.is_set).__enter__())
        time.sleep(0.3)
        assert not waiter.done()
        cancelled.set()
        with pytest.raises(BatchCancelled):
            waiter.result(5)
    leave.set()
    thread.join(5)
    with order.turn("b3", after="b1", cancelled=lambda: False):  # b1 ran: no wait
        pass


class DropEngine:
    """Enough of an engine for drop_snapshots items: records the keys in the order it dropped them."""

    def __init__(self) -> None:
        self.dropped: list[str] = []

    def drop_snapshot(self, key: str) -> None:
        self.dropped.append(key)


def drop(key: str, requester: str = "training-run/r") -> WorkItem:
    return WorkItem(key=key, requester=requester, kind=WorkKind.DROP_SNAPSHOTS, drop=DropSnapshots(keys=[key]))


def test_run_batch_runs_batches_in_dispatch_order_and_answers_each_on_one_road() -> None:
    engine = DropEngine()
    delivered: list[WorkResult] = []
    refused = {"k3"}  # this answer's signal fails: it travels whole in the batch result instead

    def deliver(requester: str, result: WorkResult) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        if result.key in refused:
            future.set_exception(RuntimeError("signal failed"))
        else:
            delivered.append(result)
            future.set_result(None)
        return future

    acts = EngineActivities(engine=cast(EngineApi, engine), store=cast(Any, None), deliver=deliver, incarnation="i1")
    first = Batch(items=[drop("k1"), drop("k2")], incarnation="i1", batch_id="b1")
    second = Batch(items=[drop("k3")], incarnation="i1", batch_id="b2", after="b1")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        later = pool.submit(ActivityEnvironment().run, acts.run_batch, second)  # handed over first
        time.sleep(0.3)
        assert engine.dropped == []
        earlier = pool.submit(ActivityEnvironment().run, acts.run_batch, first)
        results = earlier.result(10).results + later.result(10).results
    assert engine.dropped == ["k1", "k2", "k3"]
    by_key = {r.key: r for r in results}
    # Delivered: the requester has the answer; the Coordinator reads only that it succeeded.
    assert by_key["k1"].delivered and by_key["k1"].outcome.ok and by_key["k1"].outcome.json is None
    assert [r.outcome.json for r in delivered] == [{"dropped": 1}, {"dropped": 1}]
    # Not delivered: the whole answer, for the Coordinator to deliver.
    assert not by_key["k3"].delivered and by_key["k3"].outcome.json == {"dropped": 1}


def test_a_batch_cancelled_while_it_waits_is_answered_as_cancelled_and_runs_nothing() -> None:
    engine = DropEngine()
    acts = EngineActivities(engine=cast(EngineApi, engine), store=cast(Any, None), incarnation="i1")
    env = ActivityEnvironment()
    orphan = Batch(items=[drop("k1")], incarnation="i1", batch_id="b2", after="b1")  # b1 never comes
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(env.run, acts.run_batch, orphan)
        time.sleep(0.3)
        env.cancel()
        with pytest.raises(CancelledError):
            waiting.result(10)
    assert engine.dropped == []
