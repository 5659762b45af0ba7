"""Multi-tenant training sweep: 1, 2, 4, 8 tenants at once, each with its own API key and its own rank-8
LoRA run, each looping forward_backward of 8 datums + optim_step through the SDK; aggregate steps/s (one step = one
tenant's fwd/bwd + optim). Against the engine alone on the same workload: the same N adapters' forward_backward in
one Engine.forward_backward call (as the Coordinator may batch them), then each adapter's optim_step.

The stack is launched with --max-lora-adapters at least the largest tenant count; every tenant's run is created and
takes one untimed step before the sweep. The jax worker's compiles during the timed part are counted (should be 0).
A stack it launches is measured at its steady state: after the JAX worker's background warm-up has finished
(`warm_up_wait_s`: the wait; the first minutes after `up` are the cold_start benchmark's).

    python -m benchmarks.tenant_sweep [--base-url URL --api-key K ...] [--tenants 1 2 4 8] [--steps N]
"""

from __future__ import annotations

import argparse
import os
import threading
import time

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

RANK = 8


def keys(n: int) -> list[str]:
    return [f"tml-bench-tenant-{i}" for i in range(n)]


def sdk_sweep(base_url: str, api_keys: list[str], levels: list[int], steps: int, stack) -> tuple[dict, str]:
    import tinker
    from tinker import types

    clients = []
    for key in api_keys[: max(levels)]:
        service = tinker.ServiceClient(base_url=base_url, api_key=key)
        base_model = served_model(base_url, key)
        clients.append(service.create_lora_training_client(base_model=base_model, rank=RANK).result(timeout=900))
    rows = pig_latin_examples(clients[0].get_tokenizer())
    eight = sdk_datums(cycle_rows(rows, 8))
    adam = types.AdamParams(learning_rate=1e-4)

    def step(training) -> None:
        training.forward_backward(eight, "cross_entropy").result(timeout=900)
        training.optim_step(adam).result(timeout=900)

    def run(n: int, k: int) -> float:
        """Seconds for each of n tenants to take k steps, all at once (one thread per tenant, as separate users)."""
        threads = [threading.Thread(target=lambda c=c: [step(c) for _ in range(k)]) for c in clients[:n]]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - t0

    run(len(clients), 1)  # every run compiled and placed
    out = {}
    for n in levels:
        run(n, 1)  # this mix of adapters in a batch seen once
        before = worker_compiles(stack)
        seconds = run(n, steps)
        after = worker_compiles(stack)
        out[n] = {
            "steps_per_s": n * steps / seconds,
            "compilations_during_timed_part": None if before is None or after is None else after - before,
        }
    model_dir = clients[0].get_info().model_data.tokenizer_id
    assert model_dir is not None
    return out, model_dir


def engine_sweep(model_dir: str, levels: list[int], steps: int) -> dict:
    from transformers import AutoTokenizer

    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.types import AdamConfig, ForwardBackwardInput, LoraConfig

    n_max = max(levels)
    engine = Engine.load(model_dir, max_lora_adapters=max(8, n_max), max_lora_rank=32, progress=False)
    for slot in range(n_max):
        engine.create_adapter(slot, LoraConfig(rank=RANK, seed=slot))
    eight = engine_datums(cycle_rows(pig_latin_examples(AutoTokenizer.from_pretrained(model_dir)), 8))
    adam = AdamConfig(learning_rate=1e-4)

    def step(n: int) -> None:
        engine.forward_backward([ForwardBackwardInput(slot, eight, "cross_entropy") for slot in range(n)])
        for slot in range(n):
            engine.optim_step(slot, adam)

    out = {}
    for n in levels:
        step(n)
        t0 = time.perf_counter()
        for _ in range(steps):
            step(n)
        out[n] = {"steps_per_s": n * steps / (time.perf_counter() - t0)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="measure a running stack instead of launching one (give its keys)")
    parser.add_argument("--api-key", action="append", help="one per tenant, with --base-url (default: generated)")
    parser.add_argument("--tenants", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per tenant at each level (default 5)")
    args = parser.parse_args()
    n_max = max(args.tenants)
    api_keys = args.api_key or keys(n_max)
    if len(api_keys) < n_max:
        parser.error(f"--tenants up to {n_max} needs as many --api-key")
    extra = [f"--api-key={k}" for k in api_keys[1:]] + ["--max-lora-adapters", str(max(8, n_max + 1))]
    with running_stack(args.base_url, api_keys[0], extra) as (base_url, stack):
        warm_up_wait_s = wait_for_steady_state(stack)
        sdk, model_dir = sdk_sweep(base_url, api_keys, args.tenants, args.steps, stack)
        share_compile_cache(stack)
        engine = engine_sweep(model_dir, args.tenants, args.steps)
    for n in args.tenants:
        emit_pair(
            "tenant_sweep_steps_per_s",
            "steps/s",
            sdk[n]["steps_per_s"],
            engine[n]["steps_per_s"],
            tenants=n,
            rank=RANK,
            datums=8,
            **{k: v for k, v in sdk[n].items() if k != "steps_per_s"},
            warm_up_wait_s=warm_up_wait_s,
        )
    top, one = max(args.tenants), min(args.tenants)
    emit(
        figure="tenant_sweep_scaling",
        tenants=top,
        vs_tenants=one,
        tinkerflow=round(sdk[top]["steps_per_s"] / sdk[one]["steps_per_s"], 2),
        engine=round(engine[top]["steps_per_s"] / engine[one]["steps_per_s"], 2),
    )


if __name__ == "__main__":
    main()
