"""A real Ray cluster on loopback, for tests and benchmarks: `ray start --head` plus `ray start --address` nodes on the
same machine, each acting as another host with its own CPU resources; then `tinkerflow ray` submitted to it as a
Ray job (`ray job submit`), exactly as on a real cluster.

Every node gets its own loopback address (127.0.0.2, 127.0.0.3, …): Ray rewrites 127.0.0.1 itself to the machine's
network address (`resolve_ip_for_localhost`), any other 127.x address it keeps, so all traffic between the nodes, the
actors, the driver's Temporal and jax.distributed stays on loopback. Usage stats are off; the dashboard (which hosts
Ray's job server and state API, both
needed here) listens on loopback only. The cluster lives in its own short temp dir (Ray's socket paths must stay
short), and `stop` ends exactly the processes whose command line names that dir, never another Ray on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tinkerflow.cli.launch import free_port


def _bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def ray_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TINKERFLOW_", "RAY_")) and k != "XLA_FLAGS"}
    # RAY_memory_monitor_refresh_ms=0: Ray's own OOM killer judges the whole machine's memory, so on a machine shared
    # with other work it killed this cluster's job driver and actors for memory they did not use.
    env.update(
        RAY_USAGE_STATS_ENABLED="0",
        RAY_memory_monitor_refresh_ms="0",
        HF_HUB_OFFLINE="1",
        TINKER_TELEMETRY="0",
        PYTHONUNBUFFERED="1",
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    return env


@dataclass
class LocalRayCluster:
    temp_dir: Path
    gcs_address: str
    dashboard_url: str
    nodes: int
    env: dict[str, str] = field(default_factory=ray_env)

    def ray(self, *args: str, timeout_s: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        """Run the `ray` CLI against this cluster."""
        return subprocess.run(
            [_bin("ray"), *args], env=self.env, capture_output=True, text=True, timeout=timeout_s, check=check
        )

    def submit(self, entrypoint: list[str], submission_id: str) -> None:
        self.ray(
            "job",
            "submit",
            "--address",
            self.dashboard_url,
            "--submission-id",
            submission_id,
            "--no-wait",
            "--",
            *entrypoint,
        )

    def jobs(self):
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.dashboard_url)

    def job_status(self, submission_id: str) -> str:
        """PENDING, RUNNING, STOPPED, SUCCEEDED or FAILED."""
        return str(self.jobs().get_job_status(submission_id).value)

    def job_logs(self, submission_id: str) -> str:
        return self.jobs().get_job_logs(submission_id)

    def stop_job(self, submission_id: str, timeout_s: float = 120) -> str:
        """`ray job stop` (SIGTERM to the driver), then wait until the job has ended; its final status."""
        self.ray("job", "stop", "--address", self.dashboard_url, submission_id, check=False, timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        while (status := self.job_status(submission_id)) in ("PENDING", "RUNNING") and time.monotonic() < deadline:
            time.sleep(1)
        return status

    def list_state(self, what: str) -> list[dict]:
        """`ray list placement-groups|actors` (the state API) as dicts."""
        out = self.ray("list", what, "--address", self.dashboard_url, "--format", "json", "--limit", "1000")
        return json.loads(out.stdout)

    def stop(self) -> None:
        """End this cluster's processes: those whose command line names its temp dir (GCS, raylets, dashboard) and
        every process they started (agents, workers, job drivers and what those started), and only those."""
        parent, mine = {}, set()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                parent[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if str(self.temp_dir).encode() in (proc / "cmdline").read_bytes():
                    mine.add(int(proc.name))
            except (OSError, IndexError, ValueError):
                continue
        grew = True
        while grew:
            more = {pid for pid, ppid in parent.items() if ppid in mine} - mine
            mine |= more
            grew = bool(more)
        for pid in mine:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def node_ip(n: int) -> str:
    """Node n's own loopback address (not 127.0.0.1: Ray would swap that for the machine's network address)."""
    return f"127.0.0.{n + 2}"


def start_local_cluster(nodes: int = 2, cpus_per_node: int = 1, timeout_s: float = 180) -> LocalRayCluster:
    """Head plus nodes-1 more nodes, node n on 127.0.0.{n+2}, each with `cpus_per_node` CPUs and a small object
    store."""
    temp_dir = Path(tempfile.mkdtemp(prefix="rtf", dir="/tmp"))
    gcs_port, dashboard_port = free_port(), free_port()
    cluster = LocalRayCluster(temp_dir, f"{node_ip(0)}:{gcs_port}", f"http://127.0.0.1:{dashboard_port}", nodes)
    common = [
        "--num-cpus",
        str(cpus_per_node),
        "--num-gpus",
        "0",
        "--object-store-memory",
        str(80 * 1024 * 1024),
        "--disable-usage-stats",
    ]
    try:
        for n in range(nodes):
            for attempt in range(3):  # a free port picked here may be taken before Ray binds it: pick again
                # every node on this machine needs its own agent ports (a real host would have them to itself)
                ports = [
                    "--dashboard-agent-listen-port",
                    str(free_port()),
                    "--dashboard-agent-grpc-port",
                    str(free_port()),
                    "--runtime-env-agent-port",
                    str(free_port()),
                    "--metrics-export-port",
                    str(free_port()),
                ]
                if n == 0:
                    cmd = [
                        "start",
                        "--head",
                        "--port",
                        str(gcs_port),
                        "--dashboard-host",
                        "127.0.0.1",
                        "--dashboard-port",
                        str(dashboard_port),
                        "--include-dashboard",
                        "true",
                        "--ray-client-server-port",
                        str(free_port()),
                        "--temp-dir",
                        str(temp_dir),
                    ]
                else:
                    cmd = ["start", "--address", cluster.gcs_address]
                run = cluster.ray(
                    *cmd, "--node-ip-address", node_ip(n), *common, *ports, timeout_s=timeout_s, check=False
                )
                if run.returncode == 0:
                    break
                if n == 0 or attempt == 2:
                    raise RuntimeError(
                        f"`ray {' '.join(cmd[:2])}` failed for node {n}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
                    )
                time.sleep(2)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = cluster.ray("status", "--address", cluster.gcs_address, check=False)
            if status.returncode == 0 and status.stdout.count("node_") >= nodes:
                return cluster
            time.sleep(1)
        raise RuntimeError(f"the local Ray cluster has not {nodes} nodes after {timeout_s} s:\n{status.stdout}")
    except BaseException:
        cluster.stop()
        raise
