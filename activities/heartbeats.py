"""The JAX worker's activity heartbeats, sent from a side thread so one long engine call (a first compile, a big
forward_backward) still proves the worker alive to the Coordinator's heartbeat timeout."""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Generator

from temporalio import activity

# Heartbeats tell Temporal a long batch is alive; a 5 ms optimizer step needs none (each one is an RPC).
HEARTBEAT_EVERY_S = 5.0


@contextlib.contextmanager
def heartbeats(every_s: float) -> Generator[list[str], None, None]:
    """Heartbeat from a side thread while the engine works, so one long engine call still proves the worker alive.

    The thread runs in a copy of this activity's context, which is what `activity.heartbeat` looks up.
    """
    progress = ["starting"]
    done = threading.Event()
    context = contextvars.copy_context()

    def beat() -> None:
        while not done.wait(every_s):
            activity.heartbeat(progress[0])

    thread = threading.Thread(target=context.run, args=(beat,), daemon=True, name="heartbeat")
    thread.start()
    try:
        yield progress
    finally:
        done.set()
        thread.join()
