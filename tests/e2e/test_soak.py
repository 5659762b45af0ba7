"""Soak: 8 concurrent SDK clients mix training and sampling for a bounded time against one real stack.

Afterwards every request has its answer, no workflow is stuck, sessions end and give their slots and snapshots back,
and the stack's memory is flat. Each client has its own `tinker.ServiceClient` (its own session, heartbeats and event
loop) and one LoRA training client; it loops forward_backward + optim_step, every few steps saves sampler weights and
samples them, and some clients also fire bursts of concurrent `sample` calls at the base model. One client
deliberately sends an out-of-vocabulary batch now and then: that future must fail with a user error and nothing else.

The load runs for TINKERFLOW_SOAK_S seconds after a warm-up (every client through one full cycle, then 20 s without a
new jit compile: the memory baseline is taken once the compiles are done, ~2-3 min on 2 CPU cores). CI runs the short
default; the full soak is the same test by hand:

    pytest tests/e2e/test_soak.py -s                          # ~45 s of load (CI)
    TINKERFLOW_SOAK_S=600 pytest tests/e2e/test_soak.py -s    # the full soak

It prints one line `SOAK_SUMMARY {json}` (requests, errors and steady-state p50/p90 latency per kind, RSS per process
at the baseline and the end, sampler snapshots held, compiles, coordinator continue-as-news and workflow tasks over
5 s). Latency is reported, never asserted: a 2-core CI machine and an H100 differ by orders of magnitude.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Iterator

import pytest
import tinker
from temporalio.client import Client

from tests.e2e.soak_load import CLIENTS, RESULT_TIMEOUT_S, SAVE_EVERY, Ledger, Request, SoakClient, client_loop
from tests.e2e.soak_probes import (
    compiles_logged,
    describe_coordinator,
    percentile,
    rss_mb,
    running_workflows,
    settled_coordinator,
    snapshots_held,
    stack_processes,
)
from tinkerflow.cli.launch import RunningStack, launch

SOAK_S = float(os.environ.get("TINKERFLOW_SOAK_S", "45"))
WARMUP_TIMEOUT_S = 600
WARMUP_QUIET_S = 20  # the warm-up ends once the JAX worker compiled nothing new for this long
# How much RSS a process may gain between the post-warm-up baseline and the end of the load. Steady load on fixed
# shape buckets compiles nothing new, so what grows is allocator noise (+-50 MB seen on the JAX worker between
# samples) and, on the JAX worker, sampler snapshots: each is the LoRA at the padded max rank (32), 0.9 MB of float32
# for the tiny model, and one is collected only once a newer one of its run exists and it sat unsampled for 120 s, so
# the worker holds ~120 s worth of them (~200 at this load on 2 cores, more on a faster machine). Freed buffers stay
# with the allocator, so RSS follows the peak count held: 1-1.9 MB per snapshot was measured. The API and the
# workflow worker hold no per-request state (request ids say where the answer lives; finished workflows leave the
# worker's cache). A leak of tens of KB per request shows in the full soak (~10k requests); the short one catches only
# gross leaks.
RSS_GROWTH_MB = {"jax-worker": 100, "api": 75, "workflow-worker": 75}
SNAPSHOT_MB = 2.5  # the JAX worker's extra allowance per sampler snapshot held above the baseline count (peak)
# An XLA compile keeps its executable and grows the compiler's arenas: the warm-up of the soak measured ~21 MB of JAX
# worker RSS per program ((1282 - 568 MB - 31 snapshots x 1.7 MB) / 31 compiles). The warm-up ends after a quiet spell,
# so a bucket first reached later (a rarer concurrency level on a faster machine) still compiles during the load. That
# is growth with a known cause, counted in the summary (its removal is listed in docs/benchmarks.md), not a leak: it
# gets this allowance each.
COMPILE_MB = 30
WATCHED = tuple(RSS_GROWTH_MB)  # asserted; temporal (its history grows by design) is only reported

# Not `slow`: CI runs the short soak (TINKERFLOW_SOAK_S unset); the full one is TINKERFLOW_SOAK_S=600.
pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[RunningStack]:
    """Its own stack: the soak must not share slots or queues with the session-wide one. Named `stack` so the
    e2e conftest attaches its logs to a failure."""
    s = launch(
        tmp_path_factory.mktemp("soak") / "state", api_key="tml-soak", extra=["--max-lora-adapters", str(CLIENTS)]
    )
    yield s
    s.stop()


# --- the test --------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(int(SOAK_S) + WARMUP_TIMEOUT_S + 2 * RESULT_TIMEOUT_S + 300)
def test_soak_eight_clients_mixing_training_and_sampling(stack):
    model = stack.served_model()
    parts = stack_processes(stack)
    assert set(WATCHED) <= set(parts), parts
    ledger, stop = Ledger(), threading.Event()
    clients = [
        SoakClient(i, tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)) for i in range(CLIENTS)
    ]
    threads = [
        threading.Thread(target=client_loop, args=(c, model, ledger, stop), name=f"soak-{c.index}", daemon=True)
        for c in clients
    ]
    t_start = time.monotonic()
    rss_start = rss_mb(parts)
    for t in threads:
        t.start()

    try:
        # Warm-up: every client through one full cycle, then no new jit compile for a while. Which shape buckets a mix
        # needs (rows per train batch, adapters per sample batch) depends on how the coordinator happens to batch, so
        # quiet is the only sign that the compiles are done; one that still comes later is counted in the summary.
        warm_deadline = time.monotonic() + WARMUP_TIMEOUT_S
        for c in clients:
            c.warmed.wait(timeout=max(0.0, warm_deadline - time.monotonic()))
        jax_log = stack.state_dir / "logs" / "jax-worker.log"
        compiles = compiles_logged(jax_log)
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < WARMUP_QUIET_S and time.monotonic() < warm_deadline:
            time.sleep(1)
            if compiles_logged(jax_log) != compiles:
                compiles, quiet_since = compiles_logged(jax_log), time.monotonic()
        warmup_s = time.monotonic() - t_start
        rss_series, snapshots = [rss_mb(parts)], [asyncio.run(snapshots_held(stack, model))]
        load_start = time.monotonic()
        sampled_at = [0.0]
        while time.monotonic() - load_start < SOAK_S and any(t.is_alive() for t in threads):
            time.sleep(min(5.0, max(0.0, SOAK_S - (time.monotonic() - load_start))))
            rss_series.append(rss_mb(parts))
            snapshots.append(asyncio.run(snapshots_held(stack, model)))
            sampled_at.append(time.monotonic() - load_start)
        load_s = time.monotonic() - load_start
    finally:
        stop.set()  # whatever happens here, the clients stop before the stack does
    join_deadline = time.monotonic() + 2 * RESULT_TIMEOUT_S
    for t in threads:
        t.join(timeout=max(0.0, join_deadline - time.monotonic()))
    stuck_threads = [t.name for t in threads if t.is_alive()]

    # After the load: the coordinator drains, every run answered every op its client sent, nothing is in flight.
    async def inspect() -> tuple[dict, list[dict], list[str], int]:
        client = await Client.connect(stack.temporal_address)
        coordinator = await settled_coordinator(client, model)
        desc = await client.get_workflow_handle(f"coordinator/{model}/default").describe()
        stuck = [f"coordinator/{model}/default"] if desc.raw_description.pending_activities else []
        stuck += [wf.id for wf in await running_workflows(client, "SampleRequest")]
        runs = []
        for wf in await running_workflows(client, "TrainingRun"):
            handle = client.get_workflow_handle(wf.id)
            runs.append(await handle.query("describe"))
            desc = await handle.describe()
            if desc.raw_description.pending_activities or desc.raw_description.HasField("pending_workflow_task"):
                stuck.append(wf.id)
        coordinator_runs = len([wf async for wf in client.list_workflows("WorkflowType = 'Coordinator'")])
        return coordinator, runs, stuck, coordinator_runs

    coordinator, runs, stuck_workflows, coordinator_runs = asyncio.run(inspect())
    rss_after = rss_mb(parts)
    compiles_after = compiles_logged(jax_log)

    # Close every client: its session ends, its run closes, its adapter slot and sampler snapshots are given back.
    for c in clients:
        ledger.run("close", c.index, c.service.close, "success")

    async def after_close(timeout_s: float = 90) -> tuple[dict, list, list]:
        client = await Client.connect(stack.temporal_address)
        deadline = time.monotonic() + timeout_s
        while True:
            sessions = await running_workflows(client, "Session")
            open_runs = await running_workflows(client, "TrainingRun")
            d = await describe_coordinator(client, model)
            if (
                not sessions and not open_runs and not d["placements"] and d["snapshots"] == 0 and d["pending"] == 0
            ) or time.monotonic() > deadline:
                return d, [wf.id for wf in sessions], [wf.id for wf in open_runs]
            await asyncio.sleep(1)

    coordinator_closed, open_sessions, open_runs = asyncio.run(after_close())

    # --- the summary, then the verdicts ---
    by_kind: dict[str, list[Request]] = defaultdict(list)
    for r in ledger.requests:
        by_kind[r.kind].append(r)
    errors = [r for r in ledger.requests if r.outcome.startswith("error") or r.outcome == "pending"]
    summary = {
        "soak_s": round(load_s, 1),
        "warmup_s": round(warmup_s, 1),
        "clients": CLIENTS,
        "steps": [c.steps for c in clients],
        "requests": {k: len(v) for k, v in sorted(by_kind.items())},
        "provoked": sum(r.outcome == "provoked" for r in ledger.requests),
        "errors": {k: sum(r in errors for r in v) for k, v in sorted(by_kind.items())},
        "latency_ms": {
            k: {"p50": round(1000 * percentile(lat, 0.5)), "p90": round(1000 * percentile(lat, 0.9)), "n": len(lat)}
            for k, v in sorted(by_kind.items())
            if (
                lat := [r.t1 - r.t0 for r in v if r.outcome == "ok" and r.t1 is not None and r.t0 >= load_start]
            )  # steady state only: warm-up latencies are compile times
        },
        "rss_mb": {
            name: {
                "start": rss_start.get(name),
                "baseline": rss_series[0][name],
                "end": rss_series[-1][name],
                "peak": max(s[name] for s in rss_series),
                "after_settle": rss_after[name],
            }
            for name in sorted(parts)
        },
        "snapshots_held": {"baseline": snapshots[0], "end": snapshots[-1], "peak": max(snapshots)},
        # every ~30 s: [s into the load, JAX worker RSS MB, snapshots held]
        "jax_rss_series": [
            [round(t), r["jax-worker"], n]
            for k, (t, r, n) in enumerate(zip(sampled_at, rss_series, snapshots))
            if k % 6 == 0 or k == len(rss_series) - 1
        ],
        "coordinator_batches": coordinator["dispatched_batches"],
        "compiles": {"warmup": compiles, "during_load": compiles_after - compiles},
        "coordinator_runs": coordinator_runs,
        "slow_workflow_tasks": (stack.state_dir / "logs" / "workflow-worker.log")
        .read_text(errors="replace")
        .count("Workflow task duration exceeded"),
    }
    print("\nSOAK_SUMMARY " + json.dumps(summary), flush=True)

    assert not stuck_threads, f"client threads still waiting after the load: {stuck_threads}"
    assert not [c.died for c in clients if c.died], [c.died for c in clients]
    assert not errors, "\n".join(f"{r.kind} (client {r.client}): {r.outcome}" for r in errors[:20])
    assert summary["provoked"] >= 1, "the out-of-vocabulary batch never ran"
    assert all(c.steps >= SAVE_EVERY + 1 for c in clients), "a client never got through one full cycle"

    assert coordinator["pending"] == 0, coordinator
    assert not any(w["busy"] for w in coordinator["workers"].values()), coordinator
    assert len(runs) == CLIENTS, [r["start"]["model_id"] for r in runs]
    sent = {c.training.model_id: c.training._request_id_counter for c in clients}  # pyright: ignore[reportAttributeAccessIssue] (test instrumentation)
    for run in runs:
        model_id = run["start"]["model_id"]
        assert run["status"] == "ready", run
        # The SDK numbers its ops 1..n per training client; next_seq == n + 1 means all n answered, none in flight.
        assert run["next_seq"] == sent[model_id] + 1, (model_id, run["next_seq"], sent[model_id])
    assert not stuck_workflows, f"workflows with work in flight after the load settled: {stuck_workflows}"

    assert not open_sessions, f"sessions still running after close: {open_sessions}"
    assert not open_runs, f"training runs still running after their sessions ended: {open_runs}"
    assert not coordinator_closed["placements"], coordinator_closed  # every adapter slot given back
    assert coordinator_closed["snapshots"] == 0, coordinator_closed  # every ephemeral sampler snapshot dropped
    assert coordinator_closed["pending"] == 0, coordinator_closed

    for name, bound in RSS_GROWTH_MB.items():
        if name == "jax-worker":
            bound += SNAPSHOT_MB * max(0, max(snapshots) - snapshots[0])
            bound += COMPILE_MB * summary["compiles"]["during_load"]
        before, end = summary["rss_mb"][name]["baseline"], summary["rss_mb"][name]["end"]
        # The figures that explain growth go into the message: CI shows the assertion line even when it cuts the log.
        assert end - before < bound, (
            f"{name} RSS grew from {before} MB to {end} MB under steady load (bound {bound}); "
            f"snapshots {summary['snapshots_held']}, compiles {summary['compiles']}, "
            f"series [s, MB, snapshots] {summary['jax_rss_series']}"
        )
