"""Where a trivial op's time goes: per-hop timing of `forward` of 1 datum through the SDK, and the CPU
each part of the stack spends under the mixed loop (benchmarks/mixed_loop.py), optionally with py-spy profiles.

Per hop, without touching workflow code: each op is timed at the SDK (wall clock at the call and when the result is
in hand); the API's own time per route comes from its /metrics histogram (sum/count before and after); every
Temporal history event of the training-run workflow and of the Coordinator that falls inside the op's window comes
from the client's fetch_history (event times are the server's wall clock, the same machine's). Each event is
reported as its median offset from the SDK call, labelled `<workflow>:<EventType>#<k>` (the k-th of that type within
the op), so the timeline reads receive → update accepted → workflow tasks → activity scheduled/started/completed →
update completed → result in hand. The engine's own time for the op is measured alone in the same run.

CPU per part: user+system CPU seconds of each process of `up` (API, workflow worker, JAX worker, Temporal dev
server) over the mixed loop, from /proc, beside the loop's wall time. Both parts start once the JAX worker's
background warm-up has finished (the steady state: its compiles are not the op's). With --py-spy, py-spy records
the API, the workflow worker and the JAX worker during that loop, and the top self-time frames of each (of the JAX
worker, also the share of its samples in each phase of its batch activity) are printed (profiles are
written to --profile-dir, never committed).

    python -m benchmarks.control_plane [--ops N] [--loop-iterations N] [--py-spy] [--profile-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import httpx

from benchmarks.common import (
    emit,
    median,
    pig_latin_examples,
    running_stack,
    sdk_datums,
    served_model,
    time_ms,
    wait_for_steady_state,
)

API_KEY = "tml-bench-key"


def route_seconds(base_url: str, api_key: str) -> dict[str, tuple[float, float]]:
    """{route: (sum seconds, count)} of the API's request-latency histogram now."""
    text = httpx.get(f"{base_url}/metrics", headers={"X-API-Key": api_key}, timeout=10).text
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for m in re.finditer(r'^tinkerflow_api_request_seconds_(sum|count)\{route="([^"]+)"\} (\S+)$', text, re.M):
        out[m.group(2)][0 if m.group(1) == "sum" else 1] = float(m.group(3))
    return {k: (v[0], v[1]) for k, v in out.items()}


async def histories(address: str, workflow_ids: list[str]) -> dict[str, list[tuple[str, float]]]:
    """{workflow id: [(event type, wall-clock seconds)]} of each workflow's current run."""
    from temporalio.api.enums.v1 import EventType
    from temporalio.client import Client

    client = await Client.connect(address)
    out = {}
    for wid in workflow_ids:
        history = await client.get_workflow_handle(wid).fetch_history()
        out[wid] = [
            (EventType.Name(e.event_type).removeprefix("EVENT_TYPE_"), e.event_time.ToDatetime().timestamp())
            for e in history.events
        ]
    return out


def hop_timeline(windows: list[tuple[float, float]], events: dict[str, list[tuple[str, float]]]) -> dict:
    """{label: [ms after the SDK call, one per op]} for each history event inside each op's window."""
    offsets: dict[str, list[float]] = collections.defaultdict(list)
    for t0, t1 in windows:
        for short, evs in events.items():
            seen: collections.Counter[str] = collections.Counter()
            for kind, at in evs:
                if t0 <= at <= t1:
                    seen[kind] += 1
                    offsets[f"{short}:{kind}#{seen[kind]}"].append((at - t0) * 1000)
    return offsets


def per_hop(stack, base_url: str, api_key: str, ops: int) -> None:
    import tinker

    from tinkerflow.workflows.protocol import names

    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    base_model = served_model(base_url, api_key)
    training = service.create_lora_training_client(base_model=base_model, rank=8).result(timeout=900)
    one = sdk_datums(pig_latin_examples(training.get_tokenizer())[:1])
    time_ms(lambda: training.forward(one, "cross_entropy").result(timeout=900), 3)  # compiled, placed
    before = route_seconds(base_url, api_key)
    windows = []
    for _ in range(ops):
        t0 = time.time()
        training.forward(one, "cross_entropy").result(timeout=900)
        windows.append((t0, time.time()))
        time.sleep(0.05)  # a gap, so no late event of one op lands in the next one's window
    after = route_seconds(base_url, api_key)
    run_id = names.run_workflow_id(training.model_id)
    coordinator_id = names.coordinator_workflow_id(base_model, "default")
    hist = asyncio.run(histories(stack.temporal_address, [run_id, coordinator_id]))
    timeline = hop_timeline(windows, {"run": hist[run_id], "coordinator": hist[coordinator_id]})
    total = [(t1 - t0) * 1000 for t0, t1 in windows]
    emit(figure="control_plane_forward_1_datum_ms", median_ms=round(median(total), 2), n=len(total))
    for route, (s, c) in sorted(after.items()):
        ds, dc = s - before.get(route, (0.0, 0.0))[0], c - before.get(route, (0.0, 0.0))[1]
        if dc:
            emit(
                figure="control_plane_api_route_ms",
                route=route,
                mean_ms=round(1000 * ds / dc, 2),
                requests_per_op=round(dc / ops, 2),
            )
    rows = sorted(((median(v), k, len(v)) for k, v in timeline.items()), key=lambda r: r[0])
    for ms, label, n in rows:
        emit(figure="control_plane_hop", event=label, median_ms_after_call=round(ms, 2), ops_with_event=n, ops=ops)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of pid and its live children (the Temporal dev server is one binary)."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def cpu_under_loop(stack, base_url: str, api_key: str, iterations: int, py_spy: bool, profile_dir: Path) -> None:
    from benchmarks.mixed_loop import sdk_loop

    parts = stack.parts()
    sdk_loop(base_url, api_key, 0, 2, stack)  # warm-up: every shape compiled before anything is measured
    spies = []
    if py_spy:
        exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        profile_dir.mkdir(parents=True, exist_ok=True)
        for name in ("api", "workflow-worker", "jax-worker"):
            out = profile_dir / f"{name}.txt"
            spies.append(
                (
                    name,
                    out,
                    subprocess.Popen(
                        [
                            exe,
                            "record",
                            "--pid",
                            str(parts[name]["pid"]),
                            "--format",
                            "raw",
                            "--rate",
                            "100",
                            "--output",
                            str(out),
                            "--nonblocking",
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    ),
                )
            )
        time.sleep(1.0)  # py-spy attached
    before = {name: cpu_seconds(p["pid"]) for name, p in parts.items()}
    me_before = time.process_time()
    t0 = time.perf_counter()
    sdk_loop(base_url, api_key, iterations, 0, stack)
    wall = time.perf_counter() - t0
    cpu = {name: cpu_seconds(p["pid"]) - before[name] for name, p in parts.items()}
    cpu["benchmark-client (SDK)"] = time.process_time() - me_before
    for name, seconds in cpu.items():
        emit(
            figure="control_plane_cpu_under_mixed_loop",
            part=name,
            cpu_s=round(seconds, 2),
            wall_s=round(wall, 2),
            cpu_share_of_wall=round(seconds / wall, 3),
            iterations=iterations,
        )
    for name, out, proc in spies:
        proc.send_signal(2)  # SIGINT: py-spy writes its profile and exits
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        for frame, share in top_frames(out):
            emit(figure="control_plane_py_spy_top_self", part=name, frame=frame, share_of_samples=share)
        if name == "jax-worker":  # the activity phase by phase: where its time beside the engine call goes
            for frame in ACTIVITY_PHASES:
                emit(
                    figure="control_plane_py_spy_activity_phase",
                    part=name,
                    frame=frame,
                    share_of_samples=inclusive_share(out, frame),
                )
        if name == "workflow-worker":  # what passing the protocol's modules through the sandbox cut
            emit(
                figure="control_plane_py_spy_sandbox_start",
                part=name,
                frame=SANDBOX_START,
                share_of_samples=inclusive_share(out, SANDBOX_START),
            )


#: The JAX worker's batch activity and what it does around the engine call (share of the worker's busy samples
#: under each): reading bodies and writing results in the claim-check store, the run's metric points, the engine
#: call, the answers signalled home.
ACTIVITY_PHASES = (
    "EngineActivities.run_batch",
    "EngineLock.forward_backward",
    "EngineLock.sample",
    "EngineLock.optim_step",
    "ClaimCheckStore.get",
    "ClaimCheckStore.put",
    "OpPoints._record",
    "parse_forward_backward",
    "forward_backward_output",
    "WorkflowHandle.signal",
)

#: The frame under which the workflow sandbox builds a new run's instance (re-importing its modules).
SANDBOX_START = "_Instance._create_instance"


def inclusive_share(raw: Path, frame: str) -> float | None:
    """Share of py-spy's samples with `frame` (a function name as py-spy prints it) anywhere on the stack."""
    if not raw.exists():
        return None
    hit = total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            total += int(count)
            hit += int(count) if any(f.startswith(frame + " ") for f in stack.split(";")) else 0
    return round(hit / total, 3) if total else None


def top_frames(raw: Path, n: int = 12) -> list[tuple[str, float]]:
    """The n frames that were on top of the stack most often in py-spy's raw (collapsed) output, with their share."""
    if not raw.exists():
        return []
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        leaf = stack.split(";")[-1]
        counts[leaf] += int(count)
        total += int(count)
    return [(frame, round(c / total, 3)) for frame, c in counts.most_common(n)] if total else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=20, help="forward ops timed hop by hop (default 20)")
    parser.add_argument("--loop-iterations", type=int, default=10, help="mixed-loop iterations for CPU (default 10)")
    parser.add_argument(
        "--py-spy", action="store_true", help="profile the API, workflow worker and JAX worker with py-spy"
    )
    parser.add_argument("--profile-dir", default=None, help="where py-spy writes (default: a temporary directory)")
    args = parser.parse_args()
    with running_stack(None, API_KEY) as (base_url, stack):
        wait_for_steady_state(stack)  # the CPU figures are the loop's own, not the background warm-up's
        per_hop(stack, base_url, API_KEY, args.ops)
        with tempfile.TemporaryDirectory(prefix="tinkerflow-profile-") as tmp:
            cpu_under_loop(stack, base_url, API_KEY, args.loop_iterations, args.py_spy, Path(args.profile_dir or tmp))


if __name__ == "__main__":
    main()
