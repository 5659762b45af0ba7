"""More training runs than adapter slots: 10 -> 100 -> 1,000 live LoRA runs on a JAX worker with 8 slots, each
training round-robin (forward_backward of 1 datum + optim_step, every run once per round) through the unmodified SDK
against `tinkerflow up` on the tiny model; steps/s, page-in and page-out ms (the worker's /metrics histograms), page
moves per step, and host memory (the page store's bytes, the JAX worker's resident set). Beside it, the engine alone
doing the same copies: the same runs on an Engine with 8 slots, in groups of 8 (page the group in, the least
recently used out; one forward_backward call for the 8; page them again as often per step as the stack did;
optim_step each), timed the same way.

The levels are cumulative (the 100 include the 10): runs created for a level stay live for the next. Creates and
one round at each level (its batch shapes compiled, its runs paged once) are not timed.

    python -m benchmarks.paging [--base-url URL --api-key K --metrics-url URL] [--runs 10 100 1000]
                                [--rounds 3 2 1]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

from benchmarks.common import (
    cycle_rows,
    emit,
    emit_pair,
    engine_datums,
    pig_latin_examples,
    running_stack,
    sdk_datums,
    served_model,
    share_compile_cache,
    wait_for_steady_state,
    worker_compiles,
)
from tinkerflow.cli.launch import free_port

SLOTS = 8
RANK = 8
API_KEY = "tml-bench-paging"


def scrape(url: str) -> dict[str, float]:
    """The worker's paging series: {name or name{labels}: value}."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url, timeout=30).text.splitlines():
        m = re.match(r"^(tinkerflow_adapter_[a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def sdk_levels(base_url: str, levels: list[int], rounds: dict[int, int], metrics_url: str, stack) -> tuple[dict, str]:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    model = served_model(base_url, API_KEY)
    adam = types.AdamParams(learning_rate=1e-4)
    runs: list = []
    datum = None
    out: dict[int, dict] = {}

    def one_round(clients) -> None:
        steps = [(c.forward_backward(datum, "cross_entropy"), c.optim_step(adam)) for c in clients]
        for fwd, opt in steps:
            fwd.result(timeout=3600)
            opt.result(timeout=3600)

    with ThreadPoolExecutor(max_workers=16) as pool:
        for n in levels:
            fresh = n - len(runs)
            t0 = time.perf_counter()
            runs += pool.map(
                lambda i: service.create_lora_training_client(base_model=model, rank=RANK, seed=i).result(timeout=3600),
                range(len(runs), len(runs) + fresh),
            )
            creates_per_s = fresh / (time.perf_counter() - t0)
            if datum is None:
                datum = sdk_datums(cycle_rows(pig_latin_examples(runs[0].get_tokenizer()), 1))
            one_round(runs)  # this level's batch shapes compiled and its runs paged once, untimed
            before, compiles = scrape(metrics_url), worker_compiles(stack)
            t0 = time.perf_counter()
            for _ in range(rounds[n]):
                one_round(runs)
            seconds = time.perf_counter() - t0
            after, compiled = scrape(metrics_url), worker_compiles(stack)
            d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            steps = n * rounds[n]
            ins, outs = (
                d.get('tinkerflow_adapter_page_seconds_count{direction="in"}', 0.0),
                d.get('tinkerflow_adapter_page_seconds_count{direction="out"}', 0.0),
            )
            out[n] = {
                "steps_per_s": steps / seconds,
                "page_in_ms": 1e3 * d.get('tinkerflow_adapter_page_seconds_sum{direction="in"}', 0.0) / max(ins, 1),
                "page_out_ms": 1e3 * d.get('tinkerflow_adapter_page_seconds_sum{direction="out"}', 0.0) / max(outs, 1),
                "page_ins_per_step": ins / steps,
                "page_store_host_mb": after.get('tinkerflow_adapter_page_store_bytes{tier="host"}', 0.0) / 2**20,
                "worker_rss_mb": rss_bytes(stack.parts()["jax-worker"]["pid"]) / 2**20 if stack else None,
                "rounds": rounds[n],
                "creates_per_s": creates_per_s,
                "compilations_during_timed_part": None if compiles is None or compiled is None else compiled - compiles,
            }
            print(f"benchmark: stack, {n} runs: {out[n]}", flush=True, file=sys.stderr)
    model_dir = runs[0].get_info().model_data.tokenizer_id
    assert model_dir is not None
    return out, model_dir


def engine_levels(model_dir: str, levels: list[int], rounds: dict[int, int], ins_per_step: dict[int, float]) -> dict:
    """The same runs and rounds on the engine alone, paging as the Coordinator does (least recently used out)."""
    import resource

    from transformers import AutoTokenizer

    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.types import AdamConfig, ForwardBackwardInput, LoraConfig, PageMoves

    engine = Engine.load(model_dir, max_lora_adapters=SLOTS, max_lora_rank=32, progress=False)
    datum = engine_datums(cycle_rows(pig_latin_examples(AutoTokenizer.from_pretrained(model_dir)), 1))
    adam = AdamConfig(learning_rate=1e-4)
    resident: dict[int, str] = {}  # slot -> run
    created: list[str] = []
    timings: dict[str, list[float]] = {"in": [], "out": []}

    def make_resident(group: list[str], fresh: frozenset[str] = frozenset()) -> dict[str, int]:
        """Page `group` in (runs in `fresh` are created instead), paging out whatever else holds the slots."""
        where = {run: slot for slot, run in resident.items()}
        missing = [r for r in group if r not in where]
        free = [s for s in range(SLOTS) if s not in resident]
        victims = [s for s, r in resident.items() if r not in group][: max(0, len(missing) - len(free))]
        targets = free + victims
        moves = PageMoves(
            page_out=tuple((s, resident[s]) for s in victims),
            page_in=tuple((r, targets[i]) for i, r in enumerate(missing) if r not in fresh),
        )
        report = engine.page(moves)
        assert not report.failed, report.failed
        timings["out"] += report.out_seconds
        timings["in"] += report.in_seconds
        for s in victims:
            del resident[s]
        for i, r in enumerate(missing):
            resident[targets[i]] = r
            if r in fresh:
                engine.create_adapter(targets[i], LoraConfig(rank=RANK, seed=len(created)))
                created.append(r)
        return {run: slot for slot, run in resident.items()}

    def one_round(runs: list[str], cycles: int) -> None:
        for g in range(0, len(runs), SLOTS):
            group = runs[g : g + SLOTS]
            where = make_resident(group)
            engine.forward_backward([ForwardBackwardInput(where[r], datum, "cross_entropy") for r in group])
            for _ in range(cycles - 1):  # as often again as the stack paged each step (its optim_step's batch)
                for r in group:
                    del resident[where[r]]
                engine.page(PageMoves(page_out=tuple((where[r], r) for r in group)))
                where = make_resident(group)
            for r in group:
                engine.optim_step(where[r], adam)

    out: dict[int, dict] = {}
    runs: list[str] = []
    for n in levels:
        new = [f"run-{i}" for i in range(len(runs), n)]
        for g in range(0, len(new), SLOTS):
            make_resident(new[g : g + SLOTS], fresh=frozenset(new[g : g + SLOTS]))
        runs += new
        cycles = max(1, round(ins_per_step.get(n, 1.0)))
        one_round(runs, cycles)  # this level's group sizes compiled, untimed (as the stack's level)
        timings = {"in": [], "out": []}
        t0 = time.perf_counter()
        for _ in range(rounds[n]):
            one_round(runs, cycles)
        seconds = time.perf_counter() - t0
        out[n] = {
            "steps_per_s": n * rounds[n] / seconds,
            "page_in_ms": 1e3 * sum(timings["in"]) / max(1, len(timings["in"])),
            "page_out_ms": 1e3 * sum(timings["out"]) / max(1, len(timings["out"])),
            "page_ins_per_step": len(timings["in"]) / (n * rounds[n]),
            "page_store_host_mb": engine.pages.host_bytes / 2**20,
            "process_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="measure a running stack instead of launching one (its worker has 8 slots)")
    parser.add_argument("--api-key", default=API_KEY)
    parser.add_argument("--metrics-url", help="the running stack's JAX worker /metrics (with --base-url)")
    parser.add_argument("--runs", type=int, nargs="+", default=[10, 100, 1000], help="live runs at each level")
    parser.add_argument("--rounds", type=int, nargs="+", default=[3, 2, 1], help="timed rounds at each level")
    args = parser.parse_args()
    if len(args.rounds) != len(args.runs):
        parser.error("give one --rounds per --runs level")
    globals()["API_KEY"] = args.api_key
    rounds = dict(zip(args.runs, args.rounds, strict=True))
    port = free_port()
    extra = [
        "--max-lora-adapters",
        str(SLOTS),
        "--max-live-runs-per-tenant",
        str(max(args.runs) + 8),
        "--metrics-port",
        str(port),
    ]
    with running_stack(args.base_url, args.api_key, extra) as (base_url, stack):
        metrics_url = args.metrics_url or f"http://127.0.0.1:{port}/metrics"
        warm_up_wait_s = wait_for_steady_state(stack)
        sdk, model_dir = sdk_levels(base_url, args.runs, rounds, metrics_url, stack)
        share_compile_cache(stack)
        if stack is not None:  # the model outlives the stack for the engine alone, which then has the machine
            model_dir = shutil.copytree(model_dir, Path(tempfile.mkdtemp(prefix="tinkerflow-bench-model-")) / "m")
    engine = engine_levels(str(model_dir), args.runs, rounds, {n: sdk[n]["page_ins_per_step"] for n in args.runs})
    for n in args.runs:
        s, e = sdk[n], engine[n]
        common = {"runs": n, "slots": SLOTS, "rank": RANK, "datums": 1, "rounds": rounds[n]}
        emit_pair(
            "paging_steps_per_s",
            "steps/s",
            s["steps_per_s"],
            e["steps_per_s"],
            **common,
            compilations_during_timed_part=s["compilations_during_timed_part"],
            warm_up_wait_s=warm_up_wait_s,
        )
        emit_pair("paging_page_in_ms", "ms", s["page_in_ms"], e["page_in_ms"], **common)
        emit_pair("paging_page_out_ms", "ms", s["page_out_ms"], e["page_out_ms"], **common)
        emit(
            figure="paging_memory",
            **common,
            page_ins_per_step=round(s["page_ins_per_step"], 2),
            engine_page_ins_per_step=round(e["page_ins_per_step"], 2),
            page_store_host_mb=round(s["page_store_host_mb"], 1),
            engine_page_store_host_mb=round(e["page_store_host_mb"], 1),
            worker_rss_mb=None if s["worker_rss_mb"] is None else round(s["worker_rss_mb"]),
            creates_per_s=round(s["creates_per_s"], 1),
            engine_process_peak_rss_mb=round(e["process_peak_rss_mb"]),
        )


if __name__ == "__main__":
    main()
