"""`tinkerflow ray` on a real Ray cluster on this machine (a head and N-1 more nodes, `ray start`), one JSON line per
figure:

- ray_submit_to_ready_s: from `ray job submit` of the documented one-liner to the API serving the model;
- pig_latin_losses: the seeded Pig Latin loop's losses on a single-process `tinkerflow up` and on the Ray group
  (fsdp over all hosts), and their largest difference relative to the losses' scale;
- ray_actor_kill_to_next_answer_s: kill -9 of one actor (process 1 by default) with a forward_backward in flight,
  until that future is answered (the group re-formed, the run restored from its snapshot and replayed).

    python -m benchmarks.ray_group                  # 2 nodes of 1 CPU, tiny model, 3 steps, kill after step 1
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import emit

API_KEY = "tml-bench-ray"


def main() -> None:
    from tests.e2e.pig_latin_loop import pig_latin
    from tinkerflow.cli.launch import free_port, launch
    from tinkerflow.cli.ray_group import group_file
    from tinkerflow.cli.ray_local import start_local_cluster
    from tinkerflow.cli.up import served_models

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--kill-after", type=int, default=1, help="kill during this step (0-based)")
    p.add_argument("--kill-process", type=int, default=1, help="which process of the group to kill -9")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tinkerflow-bench-ray-"))

    reference = launch(root / "reference", api_key=API_KEY, extra=["--auto-snapshot-every", "2"])
    try:
        single = pig_latin(reference.base_url, API_KEY, args.steps)
    finally:
        reference.stop()

    cluster = start_local_cluster(nodes=args.hosts, cpus_per_node=1)
    try:
        port, state = free_port(), root / "ray"
        t0 = time.monotonic()
        cluster.submit(
            [
                str(Path(sys.executable).parent / "tinkerflow"),
                "ray",
                "--with-stack",
                "--hosts",
                str(args.hosts),
                "--cpus-per-host",
                "1",
                "--mesh-fsdp",
                str(args.hosts),
                "--state-dir",
                str(state),
                "--port",
                str(port),
                "--temporal-port",
                str(free_port()),
                "--headless",
                "--api-key",
                API_KEY,
                "--auto-snapshot-every",
                "2",
            ],
            "bench",
        )
        base_url = f"http://127.0.0.1:{port}"
        while not served_models(base_url, API_KEY):
            if cluster.job_status("bench") not in ("PENDING", "RUNNING"):
                raise SystemExit(cluster.job_logs("bench")[-5000:])
            time.sleep(0.5)
        emit(
            figure="ray_submit_to_ready_s", value=round(time.monotonic() - t0, 1), hosts=args.hosts, model="tiny-qwen3"
        )

        ray_losses = pig_latin(base_url, API_KEY, args.steps)
        scale = max(abs(x) for x in single)
        emit(
            figure="pig_latin_losses",
            single_process=single,
            ray=ray_losses,
            hosts=args.hosts,
            max_rel_diff=max(abs(a - b) for a, b in zip(ray_losses, single)) / scale,
        )

        before = group_file(state)
        marks = {}

        def kill(step: int, fwd) -> None:
            if step == args.kill_after:
                pid = next(p["pid"] for p in before["processes"] if p["index"] == args.kill_process)
                os.kill(pid, signal.SIGKILL)
                marks["kill"] = time.monotonic()
                fwd.result(timeout=1800)
                marks["answer"] = time.monotonic()

        after_kill = pig_latin(base_url, API_KEY, args.steps, on_step=kill)
        emit(
            figure="ray_actor_kill_to_next_answer_s",
            value=round(marks["answer"] - marks["kill"], 1),
            killed_process=args.kill_process,
            losses_after_kill=after_kill,
            same_losses=max(abs(a - b) for a, b in zip(after_kill, single)) / scale <= 1e-5,
        )
        cluster.stop_job("bench")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
