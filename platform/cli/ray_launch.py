"""`tinkerflow ray`: the JAX worker as Ray actors on an existing Ray cluster, one per host, in one placement group.

Run it as a Ray job (`ray job submit -- tinkerflow ray …`) or with `--ray-address`. Ray places and restarts the JAX
processes; Temporal stays the control plane and the durable record (docs/architecture.md §The processes). With
`--with-stack` the driver node also runs Temporal (a dev server, or `--temporal-address`), the workflow worker and the
API, so one `ray job submit` brings up the whole service.

How the group lives through a fault: cli/ray_group.py. Stopping the job (SIGTERM, Ctrl-C) stops the workers, kills
every actor and removes the placement group; if the driver itself is killed, Ray does the same (the actors and the
group belong to its job).
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
import threading
import time

from tinkerflow.cli import ray_plan, temporal_server
from tinkerflow.cli.ray_actor import node_address
from tinkerflow.cli.ray_group import RayGroup, Stopping
from tinkerflow.cli.supervise import die_with_parent
from tinkerflow.cli.up import Part, Stack, _api_ready, _port_open, child_env, listens
from tinkerflow.common.settings import Settings

log = logging.getLogger("tinkerflow.ray")


class DriverStack(Stack):
    """`up`'s parts on the driver node, each dying with the driver even when it is killed (PR_SET_PDEATHSIG), so a
    `ray job stop` that ends in SIGKILL leaves no Temporal, worker or API behind."""

    def start(self, name: str, cmd: list[str], kind: str = "") -> Part:
        log_path = self.logs / f"{name}.log"
        out = open(log_path, "ab")  # noqa: SIM115 - the child writes to it for its lifetime
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=child_env(self.settings),
            start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
        part = Part(name, proc, log_path, kind or name)
        self.parts.append(part)
        return part


def _connect(settings: Settings):
    import ray

    address = settings.ray_address or "auto"  # Settings falls back to $RAY_ADDRESS
    if ":" in address and "://" not in address and not _port_open(address):
        # ray.init would retry a GCS that is not there for minutes; say so at once
        raise RuntimeError(
            f"no Ray cluster answers at {address}: check --ray-address (the head's GCS host:port, "
            "6379 by default, or ray://head:10001), or run this as a Ray job (`ray job submit`)"
        )
    try:
        ray.init(address=address, log_to_driver=True, configure_logging=False)
    except ConnectionError as e:
        raise RuntimeError(
            f"no Ray cluster at {address!r}: start one (`ray start --head`), run this as a Ray job "
            f"(`ray job submit -- tinkerflow ray …`) or give --ray-address ({e})"
        ) from e
    return ray


def run_ray(settings: Settings, args: argparse.Namespace) -> int:
    try:
        group_plan = ray_plan.plan(settings)
    except ValueError as e:
        log.error("%s", e)
        return 2
    stop = threading.Event()
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    t_submit = time.monotonic()
    stack: DriverStack | None = None
    group: RayGroup | None = None
    try:
        ray = _connect(settings)
        # after ray.init, which installs a SIGTERM handler of its own (SystemExit) in a driver
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, _frame: stop.set())
        node_ip = node_address(ray)
        log.info(
            "joined the Ray cluster (%s) from %s: %s",
            ray.get_runtime_context().get_job_id(),
            node_ip,
            ray.cluster_resources(),
        )
        if args.with_stack:
            settings, stack = _start_control_plane(settings, args, node_ip)
        group = RayGroup(settings, group_plan, stop)
        group.place()
        group.form()
        failures = group.wait_ready()
        if failures:
            raise RuntimeError("the JAX worker group failed while starting: " + "; ".join(failures.values()))
        if stack is not None:
            part = stack.start_tinkerflow("api")
            stack.wait_ready(part, lambda: _api_ready(stack.base_url, stack.api_key) or stop.is_set())
            log.info("Tinker API at %s (TINKER_BASE_URL=%s)", stack.base_url, stack.base_url)
        log.info(
            "ready %.1f s after start: %d JAX processes, mesh fsdp=%s tp=%d",
            time.monotonic() - t_submit,
            group_plan.hosts,
            group_plan.mesh_fsdp or "all",
            group_plan.mesh_tp,
        )
        while not stop.is_set():
            failures = group.poll()
            if failures:
                t_fault = time.monotonic()
                while failures:  # a fault while the group re-forms (a second host lost) re-forms it again
                    restarted = group.reform(failures)
                    failures = group.wait_ready()
                log.info(
                    "the group is back (generation %d) %.1f s after the fault (actors restarted in %.1f s, the "
                    "rest loading the model and registering)",
                    group.generation,
                    time.monotonic() - t_fault,
                    restarted,
                )
            if stack is not None:
                dead = [p for p in stack.parts if p.proc.poll() is not None]
                if dead:
                    log.error(
                        "%s exited (%s); stopping. See %s", dead[0].name, dead[0].proc.returncode, dead[0].log_path
                    )
                    return 1
            stop.wait(0.5)
        return 0
    except Stopping:
        return 0
    except RuntimeError as e:
        log.error("%s", e)
        return 1
    finally:
        log.info("stopping …")
        if group is not None:
            group.shutdown()
        if stack is not None:
            stack.stop()
        log.info("stopped")


def _start_control_plane(settings: Settings, args: argparse.Namespace, node_ip: str) -> tuple[Settings, DriverStack]:
    """Temporal (unless --temporal-address) and the workflow worker on this node, reachable from the actors."""
    import dataclasses

    stack = DriverStack(settings)
    if not settings.is_given("temporal_address"):
        address = f"{node_ip}:{settings.temporal_port}"
        if _port_open(address):
            raise RuntimeError(
                f"{address} is busy: another Temporal runs there; pick --temporal-port or pass "
                "--temporal-address to use it"
            )
        settings = dataclasses.replace(settings, temporal_address=address)
        stack.settings = settings
        # The actors on other nodes dial it at the node's address; the dev server's own services need it bound to
        # every interface rather than to that address alone.
        bind = "127.0.0.1" if node_ip == "127.0.0.1" else "0.0.0.0"
        part = stack.start(
            "temporal",
            temporal_server.command(
                settings.state_dir / "temporal.db",
                host=bind,
                port=settings.temporal_port,
                ui_port=settings.ui_port,
                namespace=settings.temporal_namespace,
                headless=settings.headless,
            ),
        )
        stack.wait_ready(part, lambda: listens(part.proc.pid, settings.temporal_port))
    stack.start_worker("workflow-worker")
    return settings, stack
