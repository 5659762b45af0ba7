"""Op latency in a loop that trains, snapshots and samples, as an RL or eval-while-training loop does.

Each iteration: forward of 1 datum, forward_backward of 8 datums, optim_step, one training step as the cookbook's
loops make it (forward_backward of 8 datums and optim_step submitted together, then both awaited: the run starts the
optim_step without a client round trip), save_weights_and_get_sampling_client, one sample call of 4 samples x 32
tokens from that new sampler. Every op is timed from the SDK call until its result
is in hand (medians over --iterations, after --warmup iterations that compile every shape). The same loop then runs
on the engine alone in this process (forward_backward forward-only / with grads, optim_step, a sampler snapshot,
sample), on the model directory the stack serves, with the stack idle. One JSON line per op: tinkerflow's median,
the engine's, and their ratio; plus the jax worker's compile count during the timed part (it should be 0).
A stack it launches is measured at its steady state: after the JAX worker's background warm-up has finished
(`warm_up_wait_s`: the wait; the first minutes after `up` are the cold_start benchmark's).

    python -m benchmarks.mixed_loop [--base-url URL] [--iterations N] [--warmup N]
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np

from benchmarks.common import (
    cycle_rows,
    emit_pair,
    engine_datums,
    median,
    pig_latin_examples,
    running_stack,
    sampler_of,
    sdk_datums,
    served_model,
    share_compile_cache,
    stats,
    wait_for_steady_state,
    worker_compiles,
)

API_KEY = "tml-bench-key"
RANK = 8
SAMPLES, NEW_TOKENS = 4, 32
OPS = (
    "forward_1_datum",
    "forward_backward_8_datums",
    "optim_step",
    "train_step_pipelined",
    "save_weights_and_get_sampling_client",
    "sample_4x32",
)


def sdk_loop(base_url: str, api_key: str, iterations: int, warmup: int, stack) -> tuple[dict, str, dict]:
    """{op: [ms, ...]} of the timed iterations, the served model directory, and compile counts."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    base_model = served_model(base_url, api_key)
    training = service.create_lora_training_client(base_model=base_model, rank=RANK).result(timeout=900)
    tokenizer = training.get_tokenizer()
    rows = pig_latin_examples(tokenizer)
    one, eight = sdk_datums(rows[:1]), sdk_datums(cycle_rows(rows, 8))
    adam = types.AdamParams(learning_rate=1e-4)
    prompt = types.ModelInput.from_ints(rows[0][0][:8])
    params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, stop=[])
    sampler: list[Any] = [None]  # the newest sampling client

    def save() -> None:
        sampler[0] = sampler_of(training)

    ops = {
        "forward_1_datum": lambda: training.forward(one, "cross_entropy").result(timeout=900),
        "forward_backward_8_datums": lambda: training.forward_backward(eight, "cross_entropy").result(timeout=900),
        "optim_step": lambda: training.optim_step(adam).result(timeout=900),
        "train_step_pipelined": lambda: [
            f.result(timeout=900)
            for f in (training.forward_backward(eight, "cross_entropy"), training.optim_step(adam))
        ],
        "save_weights_and_get_sampling_client": save,
        "sample_4x32": lambda: (
            sampler[0].sample(prompt, num_samples=SAMPLES, sampling_params=params).result(timeout=900)
        ),
    }
    timings = _loop(ops, iterations, warmup, lambda: worker_compiles(stack))
    model_dir = training.get_info().model_data.tokenizer_id
    assert model_dir is not None  # this stack reports its model directory there
    return timings[0], model_dir, timings[1]


def engine_loop(model_dir: str, iterations: int, warmup: int) -> dict:
    from transformers import AutoTokenizer

    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.types import AdamConfig, ForwardBackwardInput, LoraConfig, SampleInput

    engine = Engine.load(model_dir, max_lora_adapters=8, max_lora_rank=32, progress=False)
    engine.create_adapter(0, LoraConfig(rank=RANK))
    rows = pig_latin_examples(AutoTokenizer.from_pretrained(model_dir))
    one, eight = engine_datums(rows[:1]), engine_datums(cycle_rows(rows, 8))
    adam = AdamConfig(learning_rate=1e-4)
    prompt = np.asarray(rows[0][0][:8], np.int32)
    n = [0]

    def save() -> None:
        if n[0]:
            engine.drop_snapshot(f"s{n[0]}")
        n[0] += 1
        engine.snapshot(0, f"s{n[0]}")

    def sample() -> None:
        req = SampleInput(
            prompt=prompt, num_samples=SAMPLES, max_tokens=NEW_TOKENS, stop_token_ids=[], snapshot=f"s{n[0]}"
        )
        engine.sample([req])

    ops = {
        "forward_1_datum": lambda: engine.forward_backward(
            [ForwardBackwardInput(0, one, "cross_entropy", forward_only=True)]
        ),
        "forward_backward_8_datums": lambda: engine.forward_backward([ForwardBackwardInput(0, eight, "cross_entropy")]),
        "optim_step": lambda: engine.optim_step(0, adam),
        "train_step_pipelined": lambda: (
            engine.forward_backward([ForwardBackwardInput(0, eight, "cross_entropy")]),
            engine.optim_step(0, adam),
        ),
        "save_weights_and_get_sampling_client": save,
        "sample_4x32": sample,
    }
    return _loop(ops, iterations, warmup, lambda: None)[0]


def _loop(ops: dict, iterations: int, warmup: int, compiles) -> tuple[dict, dict]:
    for _ in range(warmup):
        for fn in ops.values():
            fn()
    before = compiles()
    out: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(iterations):
        for name, fn in ops.items():
            t0 = time.perf_counter()
            fn()
            out[name].append((time.perf_counter() - t0) * 1000)
    after = compiles()
    return out, {"compilations_during_timed_part": None if before is None or after is None else after - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="measure a running stack instead of launching one")
    parser.add_argument("--api-key", default=API_KEY)
    parser.add_argument("--iterations", type=int, default=15, help="timed iterations of the loop (default 15)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    args = parser.parse_args()
    with running_stack(args.base_url, args.api_key) as (base_url, stack):
        warm_up_wait_s = wait_for_steady_state(stack)
        sdk, model_dir, compiles = sdk_loop(base_url, args.api_key, args.iterations, args.warmup, stack)
        share_compile_cache(stack)
        engine = engine_loop(model_dir, args.iterations, args.warmup)
    for name in OPS:
        emit_pair(
            f"mixed_loop_{name}",
            "ms",
            median(sdk[name]),
            median(engine[name]),
            sdk_p90_ms=stats(sdk[name])["p90_ms"],
            n=len(sdk[name]),
            **compiles,
            warm_up_wait_s=warm_up_wait_s,
        )


if __name__ == "__main__":
    main()
