"""The JAX worker's batches, one at a time and in the order the Coordinator dispatched them.

With pipelined dispatch (workflows/coordinator/dispatch.py) the worker takes a second batch while it runs one, so that
the second starts the moment the first ends. Its task queue may hand the two over in either order, and the second may
page out a run the first pages in, so each batch names the one it follows (`Batch.after`) and waits here until that one
has run in this process. A batch whose predecessor never comes (the Coordinator took the worker for dead and cancelled
both) leaves on its own cancellation, which the activity's heartbeats deliver.

A batch's turn ends when its items have run, before its answers are confirmed delivered: the next batch's engine
work does not wait for a signal's round trip.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Generator

# Batch ids remembered as done: far more than ever wait behind one another.
REMEMBERED_BATCHES = 1024
# How often a waiting batch looks whether it was cancelled (the heartbeat thread learns that from Temporal).
POLL_S = 0.25


class BatchOrder:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._running = False
        self._done: OrderedDict[str, None] = OrderedDict()

    @contextlib.contextmanager
    def turn(self, batch_id: str, after: str, cancelled: Callable[[], bool]) -> Generator[None, None, None]:
        """Hold the engine for one batch: once no other batch runs and `after` ("" for none) has run here. Raises
        `BatchCancelled` when `cancelled()` turns true while it waits."""
        with self._changed:
            while self._running or (after and after not in self._done):
                if cancelled():
                    raise BatchCancelled(f"cancelled while waiting for batch {after} to run first")
                self._changed.wait(POLL_S)
            self._running = True
        try:
            yield
        finally:
            with self._changed:
                self._running = False
                if batch_id:
                    self._done[batch_id] = None
                    while len(self._done) > REMEMBERED_BATCHES:
                        self._done.popitem(last=False)
                self._changed.notify_all()


class BatchCancelled(Exception):
    """The Coordinator cancelled a batch that was still waiting for its turn."""
