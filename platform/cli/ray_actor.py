"""One JAX-worker process of a `tinkerflow ray` group, as a Ray actor: the same `jax_worker.serve` that
`tinkerflow jax-worker` runs, in the actor's own process, on the bundle Ray placed it on.

The actor holds no state Ray must keep: a restarted actor is a fresh process that waits to be told its place in the
group again (`serve`), because a `jax.distributed` group can only be formed once per process and only all together.
Nothing here imports JAX before `serve`: `jax.distributed.initialize` must be the first JAX call of the process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading

from tinkerflow.common.settings import Settings

log = logging.getLogger(__name__)


def node_address(ray) -> str:
    """The address Ray knows this process's node by (`--node-ip-address`), which other nodes can dial; not the
    address the process would guess from its own interfaces."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


@dataclasses.dataclass(frozen=True)
class Whereabouts:
    """Where an actor's process runs: what the driver needs to pick a coordinator and to kill -9 it in a test."""

    index: int
    pid: int
    node_ip: str
    node_id: str


class JaxWorkerActor:
    """Made remote by the driver (`ray.remote(JaxWorkerActor).options(...)`), one per bundle; `serve` blocks for the
    worker's life, so the actor runs with max_concurrency > 1 to answer `stop` and `where` meanwhile."""

    def __init__(self, index: int, env: dict[str, str]):
        os.environ.update(env)  # before JAX is imported: platform, device visibility, HF offline
        self.index = index
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()

    def where(self) -> Whereabouts:
        import ray

        return Whereabouts(self.index, os.getpid(), node_address(ray), ray.get_runtime_context().get_node_id())

    def coordinator_address(self) -> str:
        """host:port for jax.distributed on this actor's node (asked of actor 0 only): a port free right now."""
        import ray

        ip = node_address(ray)
        with socket.socket() as s:
            s.bind((ip, 0))
            return f"{ip}:{s.getsockname()[1]}"

    def serve(self, settings: Settings, worker_id: str) -> str:
        """Run the JAX worker (process `settings.process_id` of the group) until `stop` or until it fails; a failure
        (a peer of the jax.distributed group died) raises, which tells the driver to re-form the group."""
        from tinkerflow.common.logs import setup_logging
        from tinkerflow.workers import jax_worker

        setup_logging(settings.log_level, f"ray-jax-{settings.process_id}", settings.log_format)

        async def go() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            ready = asyncio.Event()
            waiter = asyncio.create_task(ready.wait())
            waiter.add_done_callback(lambda _: self._ready.set())
            try:
                await jax_worker.serve(settings, ready=ready, stop=self._stop, worker_id=worker_id)
            finally:
                waiter.cancel()

        asyncio.run(go())
        return "stopped"

    def wait_ready(self, timeout_s: float) -> bool:
        """True once this process's worker is loaded and (process 0) registered with its coordinator."""
        return self._ready.wait(timeout_s)

    def stop(self) -> bool:
        """Let `serve` return: process 0 tells the followers to stop after the call in flight."""
        if self._loop is None or self._stop is None:
            return False
        self._loop.call_soon_threadsafe(self._stop.set)
        return True
