"""The JAX worker's Ray placement group and its actors: placing them, forming their jax.distributed group, and
re-forming it after a fault.

Faults: the processes of one jax.distributed group live and die together (a collective whose peer is gone never
completes, and a group can only be formed once per process). So when any actor dies or its worker fails, the driver
kills the others too; Ray restarts every one of them (`max_restarts`) in its bundle, the driver hands out a fresh
coordinator address and the same process ids, and process 0 registers again under the same worker id with a new
incarnation: the Coordinator then restores the runs it held from their snapshots, as for any dead JAX worker.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from tinkerflow.cli import ray_plan
from tinkerflow.cli.ray_actor import JaxWorkerActor, Whereabouts
from tinkerflow.common.settings import Settings

log = logging.getLogger("tinkerflow.ray")
PLACE_TIMEOUT_S = 600.0  # how long to wait for the cluster to fit the placement group before saying why not
LOAD_TIMEOUT_S = 900.0  # a JAX worker loading its model and compiling nothing yet
WAITING_LOG_EVERY_S = 30.0
GROUP_FILE = "ray-group.json"  # in the state dir: where each actor runs, per generation (for operators and tests)


class Stopping(Exception):
    """The driver was asked to stop while it waited."""


class RayGroup:
    """The placement group, its actors, and the forming and re-forming of their jax.distributed group."""

    def __init__(self, settings: Settings, group: ray_plan.GroupPlan, stop: threading.Event):
        import ray
        import ray.exceptions  # loaded by `import ray` too; named so checkers see self.ray.exceptions
        from ray.util.placement_group import placement_group

        self.ray = ray
        self.settings, self.group, self.stop = settings, group, stop
        self.pg = placement_group(group.bundles, strategy=group.strategy, name=f"tinkerflow-{group.pool}")
        self.actors: list = []
        self.where: list[Whereabouts] = []
        self.serving: dict = {}  # ObjectRef of each actor's `serve` call -> its index
        self.dead: set[int] = set()  # actors whose process died since the group was formed (Ray restarts them)
        self.generation = 0

    # --- placing ----------------------------------------------------------------------------------------------

    def place(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        t0 = time.monotonic()
        pending = self.pg.ready()
        while not self.ray.wait([pending], timeout=1.0)[0]:
            self._check_stop()
            waited = time.monotonic() - t0
            if waited > PLACE_TIMEOUT_S:
                raise RuntimeError(self._unplaceable(waited))
            if int(waited) and int(waited) % int(WAITING_LOG_EVERY_S) == 0:
                log.warning("%s", self._unplaceable(waited))
        log.info(
            "placement group of %d bundles %s (%s) placed in %.1f s",
            self.group.hosts,
            self.group.bundle,
            self.group.strategy,
            time.monotonic() - t0,
        )
        remote = self.ray.remote(JaxWorkerActor)
        env = ray_plan.actor_env(self.settings, self.group)
        self.actors = [
            remote.options(
                **self.group.actor_options(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote(i, env)
            for i in range(self.group.hosts)
        ]

    def _unplaceable(self, waited: float) -> str:
        return (
            f"Ray has not placed {self.group.hosts} bundles of {self.group.bundle} ({self.group.strategy}) "
            f"after {waited:.0f} s: the cluster has {self.ray.cluster_resources()} in all, "
            f"{self.ray.available_resources()} free. Add nodes, or lower --hosts / --*-per-host, or pick "
            "another --strategy"
        )

    # --- forming ----------------------------------------------------------------------------------------------

    def form(self) -> None:
        """Hand every actor its place in a new jax.distributed group and start its worker."""
        self.generation += 1
        self.where = self._get([a.where.remote() for a in self.actors])
        coordinator = self._get(self.actors[0].coordinator_address.remote()) if self.group.hosts > 1 else ""
        self.serving = {}
        for i, actor in enumerate(self.actors):
            settings = ray_plan.process_settings(self.settings, self.group, i, coordinator)
            self.serving[actor.serve.remote(settings, self.group.worker_id)] = i
        log.info(
            "generation %d of the group: %s; coordinator %s",
            self.generation,
            ", ".join(f"process {w.index} pid {w.pid} on {w.node_ip}" for w in self.where),
            coordinator or "(one process)",
        )
        self._write_group_file()

    def wait_ready(self, timeout_s: float = LOAD_TIMEOUT_S) -> dict[int, str]:
        """Until process 0 serves (loaded and registered): {} then; or the failures that came first."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_stop()
            failures = self.poll()
            if failures:
                return failures
            try:
                if self._get(self.actors[0].wait_ready.remote(1.0)):
                    return {}
            except self.ray.exceptions.RayActorError:
                time.sleep(0.5)  # process 0 died while loading: its `serve` call says so at the next poll
            if time.monotonic() > deadline:
                raise RuntimeError(f"the JAX worker group was not ready after {timeout_s:.0f} s")

    def poll(self) -> dict[int, str]:
        """The actors whose worker has ended since the group was formed, each with why."""
        if not self.serving:
            return {}
        done, _ = self.ray.wait(list(self.serving), num_returns=len(self.serving), timeout=0)
        failures = {}
        for ref in done:
            index = self.serving.pop(ref)
            try:
                outcome = self.ray.get(ref)
                failures[index] = f"process {index}'s worker returned ({outcome}) without being asked to stop"
            except self.ray.exceptions.RayActorError as e:
                self.dead.add(index)
                failures[index] = self._death(index, e)
            except self.ray.exceptions.RayTaskError as e:
                failures[index] = f"process {index}'s worker failed: {str(e.cause)[:500]}"
        return failures

    def _death(self, index: int, error: Exception) -> str:
        where = self.where[index] if index < len(self.where) else None
        if where is not None:
            node = next((n for n in self.ray.nodes() if n["NodeID"] == where.node_id), None)
            if node is not None and not node["Alive"]:
                return (
                    f"host {where.node_ip} (Ray node {where.node_id[:12]}) is lost with process {index} of the "
                    f"JAX worker; Ray re-places its bundle {self.group.bundle} when a node with those free "
                    "resources is in the cluster, and the group re-forms then"
                )
        pid = f" (pid {where.pid} on {where.node_ip})" if where is not None else ""
        return f"process {index}'s actor died{pid}: {str(error).splitlines()[0][:300]}"

    def reform(self, failures: dict[int, str]) -> float:
        """Restart every actor of the group (Ray restarts the dead; the driver kills the survivors so Ray restarts
        them too, each restart counting once against max_restarts), wait until each is back in a new process, and
        form the group again. Returns how long it took."""
        t0 = time.monotonic()
        for reason in failures.values():
            log.error("%s; re-forming the group (generation %d -> %d)", reason, self.generation, self.generation + 1)
        if self.group.max_restarts != -1 and self.generation > self.group.max_restarts:
            raise RuntimeError(
                f"the group was re-formed {self.generation - 1} times, the most --max-restarts "
                f"({self.group.max_restarts}) allows; giving up"
            )
        old = {w.index: w.pid for w in self.where}
        self.serving = {}  # the kills below end every `serve` call still running
        for i, actor in enumerate(self.actors):
            if i not in self.dead:
                self.ray.kill(actor, no_restart=False)
        self.dead = set()
        waiting_since = time.monotonic()
        for i, actor in enumerate(self.actors):
            refused = 0  # calls to a restarting actor wait for it; one that fails at once again and again is gone
            while True:
                self._check_stop()
                try:
                    where: Whereabouts = self.ray.get(actor.where.remote(), timeout=WAITING_LOG_EVERY_S)
                    if where.pid != old.get(i) or where.node_id != self.where[i].node_id:
                        break
                    time.sleep(0.2)  # the kill has not reached the old process yet
                except self.ray.exceptions.GetTimeoutError:
                    log.warning(
                        "process %d has not come back after %.0f s: Ray is waiting for room for bundle %s",
                        i,
                        time.monotonic() - waiting_since,
                        self.group.bundle,
                    )
                except self.ray.exceptions.RayActorError as e:
                    refused += 1
                    if refused > 40:
                        raise RuntimeError(f"process {i}'s actor is not coming back: {str(e)[:500]}") from e
                    time.sleep(0.5)
        self.form()
        return time.monotonic() - t0

    # --- stopping ---------------------------------------------------------------------------------------------

    def shutdown(self, grace_s: float = 20.0) -> None:
        """Stop the workers (process 0 first tells the followers), kill every actor, remove the placement group."""
        from ray.util.placement_group import remove_placement_group

        try:
            if self.serving:
                for actor in self.actors:
                    actor.stop.remote()
                self.ray.wait(list(self.serving), num_returns=len(self.serving), timeout=grace_s)
        except Exception as e:  # noqa: BLE001 — stopping anyway
            log.warning("stopping the workers: %s", e)
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception as e:  # noqa: BLE001
                log.warning("killing an actor: %s", e)
        remove_placement_group(self.pg)
        log.info("every actor killed and the placement group removed")

    # --- helpers ----------------------------------------------------------------------------------------------

    def _check_stop(self) -> None:
        if self.stop.is_set():
            raise Stopping()

    def _get(self, ref: Any) -> Any:
        while True:
            self._check_stop()
            ready, _ = self.ray.wait(
                ref if isinstance(ref, list) else [ref],
                num_returns=len(ref) if isinstance(ref, list) else 1,
                timeout=1.0,
            )
            if ready and len(ready) == (len(ref) if isinstance(ref, list) else 1):
                return self.ray.get(ref)

    def _write_group_file(self) -> None:
        path = self.settings.state_dir / GROUP_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "generation": self.generation,
                    "worker_id": self.group.worker_id,
                    "processes": [w.__dict__ for w in self.where],
                }
            )
        )
        tmp.replace(path)


def group_file(state_dir: Path) -> dict:
    """What the driver last wrote about the group (generation, worker id, each process's pid and node)."""
    return json.loads((state_dir / GROUP_FILE).read_text())
