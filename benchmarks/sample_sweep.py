"""Sampling concurrency sweep: N concurrent SDK sample calls of 4 samples x 32 tokens each, for N in
--concurrency (default 1 8 32 128), aggregate generated tokens/s, against the engine alone doing the same total
workload (the same N requests handed to Engine.sample in one call, on the same model and a LoRA snapshot).

For each N the first round is timed apart (`first_round_s`: a shape first seen compiles there, which the target wants
never to happen inside a workload) and the jax worker's compiles during the timed rounds are counted (should be 0).
A stack it launches is measured at its steady state: after the JAX worker's background warm-up has finished
(`warm_up_wait_s`: the wait; the first minutes after `up` are the cold_start benchmark's).

    python -m benchmarks.sample_sweep [--base-url URL] [--concurrency 1 8 32 128] [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np

from benchmarks.common import (
    emit,
    emit_pair,
    running_stack,
    sampler_of,
    served_model,
    share_compile_cache,
    wait_for_steady_state,
    worker_compiles,
)

API_KEY = "tml-bench-key"
SAMPLES, NEW_TOKENS = 4, 32


def prompt_ids(i: int) -> list[int]:
    """Short distinct prompts (8 ids), valid in any vocabulary of the tiny model's size or larger."""
    return [1 + (i * 7 + j) % 200 for j in range(8)]


def sdk_sweep(base_url: str, api_key: str, levels: list[int], rounds: int, stack) -> tuple[dict, str]:
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    base_model = served_model(base_url, api_key)
    training = service.create_lora_training_client(base_model=base_model, rank=8).result(timeout=900)
    sampler = sampler_of(training)
    params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, stop=[])

    def one_round(n: int) -> int:
        futures = [
            sampler.sample(types.ModelInput.from_ints(prompt_ids(i)), num_samples=SAMPLES, sampling_params=params)
            for i in range(n)
        ]
        return sum(len(s.tokens) for f in futures for s in f.result(timeout=900).sequences)

    out = {}
    for n in levels:
        out[n] = _measure(lambda n=n: one_round(n), rounds, lambda: worker_compiles(stack))
    model_dir = training.get_info().model_data.tokenizer_id
    assert model_dir is not None
    return out, model_dir


def engine_sweep(model_dir: str, levels: list[int], rounds: int) -> dict:
    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.types import LoraConfig, SampleInput, SampleResult

    engine = Engine.load(model_dir, max_lora_adapters=8, max_lora_rank=32, progress=False)
    engine.create_adapter(0, LoraConfig(rank=8))
    engine.snapshot(0, "bench")

    def one_round(n: int) -> int:
        reqs = [
            SampleInput(
                prompt=np.asarray(prompt_ids(i), np.int32),
                num_samples=SAMPLES,
                max_tokens=NEW_TOKENS,
                stop_token_ids=[],
                snapshot="bench",
            )
            for i in range(n)
        ]
        results = engine.sample(reqs)
        return sum(len(s.tokens) for r in results if isinstance(r, SampleResult) for s in r.sequences)

    return {n: _measure(lambda n=n: one_round(n), rounds, lambda: None) for n in levels}


def _measure(round_fn, rounds: int, compiles) -> dict:
    t0 = time.perf_counter()
    round_fn()
    first = time.perf_counter() - t0
    before = compiles()
    tokens, t0 = 0, time.perf_counter()
    for _ in range(rounds):
        tokens += round_fn()
    seconds = time.perf_counter() - t0
    after = compiles()
    return {
        "tokens_per_s": tokens / seconds,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "first_round_s": round(first, 3),
        "compilations_during_timed_part": None if before is None or after is None else after - before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="measure a running stack instead of launching one")
    parser.add_argument("--api-key", default=API_KEY)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per level after one untimed (default 3)")
    args = parser.parse_args()
    with running_stack(args.base_url, args.api_key) as (base_url, stack):
        warm_up_wait_s = wait_for_steady_state(stack)
        sdk, model_dir = sdk_sweep(base_url, args.api_key, args.concurrency, args.rounds, stack)
        share_compile_cache(stack)
        engine = engine_sweep(model_dir, args.concurrency, args.rounds)
    for n in args.concurrency:
        s, e = sdk[n], engine[n]
        emit_pair(
            "sample_sweep_tokens_per_s",
            "tok/s",
            s["tokens_per_s"],
            e["tokens_per_s"],
            concurrency=n,
            samples=SAMPLES,
            new_tokens=NEW_TOKENS,
            first_round_s=s["first_round_s"],
            engine_first_round_s=e["first_round_s"],
            compilations_during_timed_part=s["compilations_during_timed_part"],
            warm_up_wait_s=warm_up_wait_s,
        )
    top, one = max(args.concurrency), min(args.concurrency)
    emit(
        figure="sample_sweep_scaling",
        concurrency=top,
        vs_concurrency=one,
        tinkerflow=round(sdk[top]["tokens_per_s"] / sdk[one]["tokens_per_s"], 2),
        engine=round(engine[top]["tokens_per_s"] / engine[one]["tokens_per_s"], 2),
    )


if __name__ == "__main__":
    main()
