"""The engine's duty cycle under saturating multi-tenant training: how much of the wall time the JAX worker's engine
is busy while every tenant loops as fast as it can, against the engine alone on the same workload.

Two loads (`--loads`, each TENANTSxDATUMSxTOKENS): 4 tenants each looping forward_backward of 64 datums of 200 tokens
+ optim_step (big batches: the control plane's time between them is small beside the engine's), and 8 tenants each
looping forward_backward of 8 datums of 20 tokens + optim_step (small batches: every millisecond between two
batches shows). Each tenant has its own API key and rank-8 run and runs its loop on a thread of its own, through the
unmodified SDK. Busy time is the JAX worker's own `tinkerflow_engine_op_seconds` (summed over kinds: every group of
a batch, store reads and writes included), read from its /metrics before and after the timed part; duty cycle =
busy / wall. Steps/s: one step is one tenant's forward_backward + optim_step.

The engine alone does the same steps in this process: the N tenants' forward_backward in one Engine.forward_backward
call (as the Coordinator batches them), then each adapter's optim_step; its duty cycle is the time inside those
calls over the loop's wall time (what a caller with nothing between calls gets), beside its steps/s.

A stack it launches is measured at its steady state (after the JAX worker's background warm-up has finished); a few
untimed rounds first compile every shape the mix of tenants in a batch produces, and the compiles inside the timed
part are counted (should be 0).

    python -m benchmarks.duty_cycle [--loads 4x64x200 8x8x20] [--seconds S] [--base-url URL --metrics-url URL]
"""

from __future__ import annotations

import argparse
import os
import re
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import httpx
import numpy as np

from benchmarks.common import (
    emit_pair,
    running_stack,
    served_model,
    share_compile_cache,
    wait_for_steady_state,
    worker_compiles,
)

RANK = 8
LOADS = ("4x64x200", "8x8x20")


def parse_load(text: str) -> tuple[int, int, int]:
    tenants, datums, tokens = (int(x) for x in text.lower().split("x"))
    return tenants, datums, tokens


def keys(n: int) -> list[str]:
    return [f"tml-bench-duty-{i}" for i in range(n)]


def rows(n: int, tokens: int, vocab: int, seed: int) -> list[tuple[list[int], list[int], list[float]]]:
    """n datums of `tokens` tokens each (inputs, shifted targets, unit weights), drawn from `seed`."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(1, vocab, tokens + 1).tolist()
        out.append((ids[:-1], ids[1:], [1.0] * tokens))
    return out


def engine_busy_seconds(metrics_url: str) -> float:
    """The JAX worker's tinkerflow_engine_op_seconds, summed over kinds, now."""
    text = httpx.get(metrics_url, timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(r"^tinkerflow_engine_op_seconds_sum\{[^}]*\} (\S+)$", text, re.M))


def sdk_load(base_url: str, api_keys: list[str], metrics_url: str, load: str, seconds: float, stack) -> dict:
    import tinker
    from tinker import types

    from benchmarks.common import sdk_datums

    tenants, datums, tokens = parse_load(load)
    clients = []
    for key in api_keys[:tenants]:
        service = tinker.ServiceClient(base_url=base_url, api_key=key)
        model = served_model(base_url, key)
        clients.append(service.create_lora_training_client(base_model=model, rank=RANK).result(timeout=900))
    vocab = clients[0].get_tokenizer().vocab_size
    data = [sdk_datums(rows(datums, tokens, vocab, seed=n)) for n in range(tenants)]
    adam = types.AdamParams(learning_rate=1e-4)

    def loop(n: int, until: float, steps: list[int]) -> None:
        training = clients[n]
        while time.perf_counter() < until:
            training.forward_backward(data[n], "cross_entropy").result(timeout=900)
            training.optim_step(adam).result(timeout=900)
            steps[n] += 1

    def run(duration: float) -> tuple[int, float]:
        steps = [0] * tenants
        until = time.perf_counter() + duration
        threads = [threading.Thread(target=loop, args=(n, until, steps)) for n in range(tenants)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(steps), time.perf_counter() - t0

    run(max(5.0, seconds / 2))  # every mix of tenants in a batch seen (and compiled) before the timed part
    compiles = worker_compiles(stack)
    busy = engine_busy_seconds(metrics_url)
    steps, wall = run(seconds)
    busy = engine_busy_seconds(metrics_url) - busy
    after = worker_compiles(stack)
    model_dir = clients[0].get_info().model_data.tokenizer_id
    return {
        "duty": busy / wall,
        "steps_per_s": steps / wall,
        "busy_s": busy,
        "wall_s": wall,
        "compilations_during_timed_part": None if compiles is None or after is None else after - compiles,
        "model_dir": model_dir,
    }


def engine_load(model_dir: str, load: str, seconds: float) -> dict:
    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.types import AdamConfig, Datum, ForwardBackwardInput, LoraConfig

    tenants, datums, tokens = parse_load(load)
    engine = Engine.load(model_dir, max_lora_adapters=max(8, tenants), max_lora_rank=32, progress=False)
    for slot in range(tenants):
        engine.create_adapter(slot, LoraConfig(rank=RANK, seed=slot))
    vocab = engine.info.vocab_size
    data = [
        [
            Datum(
                tokens=np.asarray(t, np.int32),
                inputs={"target_tokens": np.asarray(y, np.int64), "weights": np.asarray(w, np.float32)},
            )
            for t, y, w in rows(datums, tokens, vocab, seed=n)
        ]
        for n in range(tenants)
    ]
    adam = AdamConfig(learning_rate=1e-4)
    busy = [0.0]

    def step() -> None:
        t0 = time.perf_counter()
        engine.forward_backward([ForwardBackwardInput(slot, data[slot], "cross_entropy") for slot in range(tenants)])
        for slot in range(tenants):
            engine.optim_step(slot, adam)
        busy[0] += time.perf_counter() - t0

    for _ in range(2):
        step()
    busy[0], rounds = 0.0, 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        step()
        rounds += 1
    wall = time.perf_counter() - t0
    return {"duty": busy[0] / wall, "steps_per_s": rounds * tenants / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="measure a running stack instead of launching one (give its keys)")
    parser.add_argument("--api-key", action="append", help="one per tenant, with --base-url (default: generated)")
    parser.add_argument("--metrics-url", help="the JAX worker's /metrics, with --base-url")
    parser.add_argument("--loads", nargs="+", default=list(LOADS), help="TENANTSxDATUMSxTOKENS (default: both)")
    parser.add_argument("--seconds", type=float, default=20.0, help="timed seconds per load (default 20)")
    args = parser.parse_args()
    n_max = max(parse_load(load)[0] for load in args.loads)
    api_keys = args.api_key or keys(n_max)
    if len(api_keys) < n_max:
        parser.error(f"loads of up to {n_max} tenants need as many --api-key")
    if args.base_url and not args.metrics_url:
        parser.error("--base-url needs --metrics-url (the JAX worker's /metrics)")
    from tinkerflow.cli.launch import free_port

    port = free_port()
    metrics_url = args.metrics_url or f"http://127.0.0.1:{port}/metrics"
    extra = [f"--api-key={k}" for k in api_keys[1:]]
    extra += ["--max-lora-adapters", str(max(8, n_max + 1)), "--metrics-port", str(port)]
    results = {}
    load_before = os.getloadavg()
    with running_stack(args.base_url, api_keys[0], extra) as (base_url, stack):
        warm_up_wait_s = wait_for_steady_state(stack)
        for load in args.loads:
            results[load] = sdk_load(base_url, api_keys, metrics_url, load, args.seconds, stack)
        share_compile_cache(stack)
        engine = {load: engine_load(results[load]["model_dir"], load, args.seconds) for load in args.loads}
    for load in args.loads:
        tenants, datums, tokens = parse_load(load)
        sdk = results[load]
        emit_pair(
            "duty_cycle_engine_busy",
            "fraction",
            sdk["duty"],
            engine[load]["duty"],
            tenants=tenants,
            datums=datums,
            tokens=tokens,
            steps_per_s=round(sdk["steps_per_s"], 2),
            engine_steps_per_s=round(engine[load]["steps_per_s"], 2),
            busy_s=round(sdk["busy_s"], 2),
            wall_s=round(sdk["wall_s"], 2),
            compilations_during_timed_part=sdk["compilations_during_timed_part"],
            warm_up_wait_s=warm_up_wait_s,
            load_average=[round(x, 2) for x in load_before + os.getloadavg()],
        )


if __name__ == "__main__":
    main()
