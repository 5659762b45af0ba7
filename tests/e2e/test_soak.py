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
import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil
import pytest
import tinker
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode
from tinker import types

from tinkerflow.cli.launch import RunningStack, launch

SOAK_S = float(os.environ.get("TINKERFLOW_SOAK_S", "45"))
CLIENTS = 8
BASE_SAMPLERS = (2, 5)  # clients that also fire bursts of concurrent samples at the base model
PROVOKER = 0  # the client that sometimes sends an out-of-vocabulary batch
SAVE_EVERY = 3  # steps between save_weights_and_get_sampling_client
BURST = 12  # concurrent base-model sample futures per burst
RESULT_TIMEOUT_S = 300  # per future: far above any answer (a cold jit compile on 2 cores is ~tens of s)
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


# --- bookkeeping -----------------------------------------------------------------------------------------------------


@dataclass
class Request:
    kind: str
    client: int
    t0: float
    provoked: bool = False
    t1: float | None = None
    outcome: str = "pending"  # pending | ok | provoked (failed as meant to) | error: ...


@dataclass
class Ledger:
    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def track(self, kind: str, client: int, submit, *args, provoked: bool = False, **kwargs):
        """Submit `submit(*args, **kwargs)` (timed from before the call); note when its future completes."""
        r = Request(kind, client, time.monotonic(), provoked)
        with self.lock:
            self.requests.append(r)
        try:
            future = submit(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 — every outcome is recorded and judged at the end
            r.t1, r.outcome = time.monotonic(), f"error at submit: {type(e).__name__}: {str(e)[:300]}"
            return r, None
        future.future().add_done_callback(lambda _f: setattr(r, "t1", time.monotonic()))
        return r, future

    def resolve(self, r: Request, future, check=None):
        """Wait for one future (never unbounded); record how it ended. Returns its result, or None."""
        if future is None:
            return None
        try:
            result = future.result(timeout=RESULT_TIMEOUT_S)
        except TimeoutError:
            r.outcome = f"error: no answer within {RESULT_TIMEOUT_S} s"
            return None
        except Exception as e:  # noqa: BLE001
            r.t1 = r.t1 or time.monotonic()
            meant = r.provoked and isinstance(e, tinker.RequestFailedError) and "1000000" in str(e)
            r.outcome = "provoked" if meant else f"error: {type(e).__name__}: {str(e)[:300]}"
            return None
        r.t1 = r.t1 or time.monotonic()
        if r.provoked:
            r.outcome = "error: the out-of-vocabulary batch succeeded"
            return None
        try:
            if check is not None:
                check(result)
        except AssertionError as e:
            r.outcome = f"error: wrong answer: {e}"
            return None
        r.outcome = "ok"
        return result

    def run(self, kind: str, client: int, submit, *args, check=None, **kwargs):
        """Submit and wait: the answer (or None, with the failure recorded)."""
        return self.resolve(*self.track(kind, client, submit, *args, **kwargs), check)


# --- the load --------------------------------------------------------------------------------------------------------


def _datum(rng: random.Random, n: int = 24) -> types.Datum:
    tokens = [rng.randrange(3, 1500) for _ in range(n + 1)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n},  # pyright: ignore[reportArgumentType] (Datum converts lists)
    )


def _check_fwdbwd(n_tokens: list[int]):
    def check(out) -> None:
        assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == n_tokens, "logprobs per datum"
        assert out.metrics["loss:sum"] == out.metrics["loss:sum"], "loss is NaN"

    return check


def _check_samples(num_samples: int, max_tokens: int):
    def check(out) -> None:
        assert len(out.sequences) == num_samples, f"{len(out.sequences)} sequences, wanted {num_samples}"
        assert all(len(s.tokens) == max_tokens for s in out.sequences), "sequence lengths"

    return check


@dataclass
class SoakClient:
    index: int
    service: tinker.ServiceClient
    training: object = None
    steps: int = 0
    warmed: threading.Event = field(default_factory=threading.Event)
    died: str = ""


def _prompt(rng: random.Random) -> types.ModelInput:
    return types.ModelInput.from_ints([rng.randrange(3, 1500) for _ in range(rng.randint(4, 12))])


OOV = types.Datum(
    model_input=types.ModelInput.from_ints([1, 2, 10**6, 3]),
    loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4},  # pyright: ignore[reportArgumentType] (Datum converts lists)
)


def client_loop(c: SoakClient, model: str, ledger: Ledger, stop: threading.Event) -> None:
    i, rng = c.index, random.Random(c.index)
    lora_params = types.SamplingParams(max_tokens=8, temperature=1.0, stop=[])
    base_params = types.SamplingParams(max_tokens=6, temperature=0.8, stop=[])
    try:
        c.training = ledger.run(
            "create_model", i, c.service.create_lora_training_client, base_model=model, rank=(4, 8)[i % 2]
        )
        if c.training is None:
            c.died = "create_lora_training_client failed"
            return
        base = None
        if i in BASE_SAMPLERS:
            base = ledger.run("create_sampling_client", i, c.service.create_sampling_client, base_model=model)
        while not stop.is_set():
            # fwd/bwd and optim_step pipelined, as the SDK means them to be (the run orders them by seq_id)
            fb = ledger.track(
                "forward_backward", i, c.training.forward_backward, [_datum(rng) for _ in range(4)], "cross_entropy"
            )
            bad = None
            if i == PROVOKER and c.steps % 5 == 4:
                bad = ledger.track(
                    "forward_backward", i, c.training.forward_backward, [OOV], "cross_entropy", provoked=True
                )
            opt = ledger.track("optim_step", i, c.training.optim_step, types.AdamParams(learning_rate=1e-4))
            ledger.resolve(*fb, _check_fwdbwd([24] * 4))
            if bad is not None:
                ledger.resolve(*bad)
            ledger.resolve(*opt)
            c.steps += 1
            if c.steps % SAVE_EVERY == 1:
                sampler = ledger.run(
                    "save_weights_and_get_sampling_client", i, c.training.save_weights_and_get_sampling_client
                )
                if sampler is not None:
                    futures = [
                        ledger.track(
                            "sample_lora",
                            i,
                            sampler.sample,
                            prompt=_prompt(rng),
                            num_samples=2,
                            sampling_params=lora_params,
                        )
                        for _ in range(2)
                    ]
                    for f in futures:
                        ledger.resolve(*f, _check_samples(2, 8))
            if base is not None:
                futures = [
                    ledger.track(
                        "sample_base", i, base.sample, prompt=_prompt(rng), num_samples=1, sampling_params=base_params
                    )
                    for _ in range(BURST)
                ]
                for f in futures:
                    ledger.resolve(*f, _check_samples(1, 6))
            if c.steps >= SAVE_EVERY + 1:  # one full cycle (train, save, sample lora and base) done
                c.warmed.set()
    except Exception as e:  # noqa: BLE001 — a client thread that dies is reported, not swallowed
        c.died = f"{type(e).__name__}: {e}"
    finally:
        c.warmed.set()


# --- observation -----------------------------------------------------------------------------------------------------


def stack_processes(stack: RunningStack) -> dict[str, psutil.Process]:
    """The parts `tinkerflow up` started, by name (their command line says which)."""
    parts = {}
    for p in psutil.Process(stack.proc.pid).children():
        cmd = p.cmdline()
        if "tinkerflow.cli.main" in cmd:
            parts[cmd[cmd.index("tinkerflow.cli.main") + 1]] = p
        elif any("temporal" in a for a in cmd[:1]):
            parts["temporal"] = p
    return parts


def rss_mb(parts: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, p in parts.items():
        total = 0
        for q in [p, *p.children(recursive=True)]:
            try:
                total += q.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        out[name] = round(total / 2**20, 1)
    return out


def _compiles(jax_log) -> int:
    """jit compiles the JAX worker has logged so far (one INFO line each)."""
    return jax_log.read_text(errors="replace").count("aot_cache: compiled")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _coordinator(client: Client, model: str, timeout_s: float = 60) -> dict:
    """The coordinator's `describe`. Temporal buffers one query while a workflow task runs and refuses more
    (RESOURCE_EXHAUSTED, "consistent query buffer is full"); the API queries it too, and under load one of its tasks
    can run for seconds (a continue-as-new rejected for signals that came meanwhile replays the whole history), so
    retry that for a while."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await client.get_workflow_handle(f"coordinator/{model}/default").query("describe")
        except RPCError as e:
            if e.status != RPCStatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            await asyncio.sleep(1)


async def _snapshots_held(stack: RunningStack, model: str) -> int:
    return (await _coordinator(await Client.connect(stack.temporal_address), model))["snapshots"]


async def _settled(client: Client, model: str, timeout_s: float = 60) -> dict:
    """The coordinator once nothing is pending and no worker is busy (or its last state when the time is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        d = await _coordinator(client, model)
        if (d["pending"] == 0 and not any(w["busy"] for w in d["workers"].values())) or time.monotonic() > deadline:
            return d
        await asyncio.sleep(0.5)


async def _running(client: Client, workflow_type: str) -> list:
    """Running workflows of a type; each confirmed by a describe (the visibility list may lag a just-closed one)."""
    query = f"WorkflowType = '{workflow_type}' AND ExecutionStatus = 'Running'"
    listed = [wf async for wf in client.list_workflows(query)]
    return [
        wf
        for wf in listed
        if (await client.get_workflow_handle(wf.id).describe()).status == WorkflowExecutionStatus.RUNNING
    ]


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
        compiles = _compiles(jax_log)
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < WARMUP_QUIET_S and time.monotonic() < warm_deadline:
            time.sleep(1)
            if _compiles(jax_log) != compiles:
                compiles, quiet_since = _compiles(jax_log), time.monotonic()
        warmup_s = time.monotonic() - t_start
        rss_series, snapshots = [rss_mb(parts)], [asyncio.run(_snapshots_held(stack, model))]
        load_start = time.monotonic()
        sampled_at = [0.0]
        while time.monotonic() - load_start < SOAK_S and any(t.is_alive() for t in threads):
            time.sleep(min(5.0, max(0.0, SOAK_S - (time.monotonic() - load_start))))
            rss_series.append(rss_mb(parts))
            snapshots.append(asyncio.run(_snapshots_held(stack, model)))
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
        coordinator = await _settled(client, model)
        desc = await client.get_workflow_handle(f"coordinator/{model}/default").describe()
        stuck = [f"coordinator/{model}/default"] if desc.raw_description.pending_activities else []
        stuck += [wf.id for wf in await _running(client, "SampleRequest")]
        runs = []
        for wf in await _running(client, "TrainingRun"):
            handle = client.get_workflow_handle(wf.id)
            runs.append(await handle.query("describe"))
            desc = await handle.describe()
            if desc.raw_description.pending_activities or desc.raw_description.HasField("pending_workflow_task"):
                stuck.append(wf.id)
        coordinator_runs = len([wf async for wf in client.list_workflows("WorkflowType = 'Coordinator'")])
        return coordinator, runs, stuck, coordinator_runs

    coordinator, runs, stuck_workflows, coordinator_runs = asyncio.run(inspect())
    rss_after = rss_mb(parts)
    compiles_after = _compiles(jax_log)

    # Close every client: its session ends, its run closes, its adapter slot and sampler snapshots are given back.
    for c in clients:
        ledger.run("close", c.index, c.service.close, "success")

    async def after_close(timeout_s: float = 90) -> tuple[dict, list, list]:
        client = await Client.connect(stack.temporal_address)
        deadline = time.monotonic() + timeout_s
        while True:
            sessions = await _running(client, "Session")
            open_runs = await _running(client, "TrainingRun")
            d = await _coordinator(client, model)
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
