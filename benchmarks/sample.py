"""Sampling throughput: one request with one sample, and 64 concurrent requests × 4 samples × 64 new tokens,
through the SDK (HTTP → Temporal → coordinator batching → JAX worker) and in the engine alone. Also counts
compilations during the timed part, which must be zero: shapes are bucketed so a steady workload compiles nothing.

    python -m benchmarks.sample [--base-url URL] [--repeats N]
    python -m benchmarks.sample --moe [--repeats N]   # the MoE shape, engine vs bare JAX (benchmarks/sample_moe.py)
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np
import tinker
from tinker import types

from benchmarks.common import emit, running_stack, worker_compiles

API_KEY = "tml-bench-key"
NEW_TOKENS = 64
PROMPTS = ["Tell me a story:", "Say something:", "Write a word:", "Continue:"]


def _prompt_tokens(tokenizer, i: int) -> list[int]:
    return tokenizer.encode(f"{PROMPTS[i % len(PROMPTS)]} {i}")


def sdk_figures(base_url: str, stack, repeats: int) -> tuple[dict, str]:
    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    model = service.create_lora_training_client(base_model=stack_model(base_url), rank=8).result()
    tokenizer = model.get_tokenizer()
    sampler = model.save_weights_and_get_sampling_client()
    if not isinstance(sampler, tinker.SamplingClient):  # newer SDKs hand back a future of the client
        sampler = sampler.result()
    params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, stop=[])

    def single() -> int:
        r = sampler.sample(
            prompt=types.ModelInput.from_ints(_prompt_tokens(tokenizer, 0)), num_samples=1, sampling_params=params
        ).result()
        return sum(len(s.tokens) for s in r.sequences)

    def concurrent() -> int:
        futures = [
            sampler.sample(
                prompt=types.ModelInput.from_ints(_prompt_tokens(tokenizer, i)), num_samples=4, sampling_params=params
            )
            for i in range(64)
        ]
        return sum(len(s.tokens) for f in futures for s in f.result().sequences)

    out = {}
    for name, fn in (("single_1x1", single), ("concurrent_64x4", concurrent)):
        fn()  # warm-up compiles this workload's shapes
        before = worker_compiles(stack)
        tokens, seconds = 0, 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            tokens += fn()
            seconds += time.perf_counter() - t0
        after = worker_compiles(stack)
        out[name] = {
            "tokens_per_s": round(tokens / seconds, 1),
            "tokens": tokens,
            "seconds": round(seconds, 3),
            "compilations_during_timed_part": None if before is None or after is None else after - before,
        }
    tokenizer_id = model.get_info().model_data.tokenizer_id
    assert tokenizer_id is not None  # this stack reports its model directory there
    return out, tokenizer_id


def stack_model(base_url: str) -> str:
    import httpx

    caps = httpx.get(f"{base_url}/api/v1/get_server_capabilities", headers={"X-API-Key": API_KEY}).json()
    return caps["supported_models"][0]["model_name"]


_XLA_COMPILES = [0]


def _count_xla_compiles() -> None:
    """Count every XLA compile in this process (AotCache programs, jitted helpers and eager ops alike)."""
    import jax

    def listener(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            _XLA_COMPILES[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)


def engine_figures(model_dir: str, repeats: int) -> dict:
    from transformers import AutoTokenizer

    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.runtime.aot_cache import AotCache
    from tinkerflow.workers.engine.types import SampleInput, SampleResult

    engine = Engine.load(model_dir, max_lora_adapters=8, max_lora_rank=32, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def run(n_requests: int, n_samples: int) -> int:
        reqs = [
            SampleInput(
                prompt=np.asarray(_prompt_tokens(tokenizer, i), np.int32),
                num_samples=n_samples,
                max_tokens=NEW_TOKENS,
                temperature=1.0,
                stop_token_ids=[],
            )
            for i in range(n_requests)
        ]
        results = engine.sample(reqs)
        assert all(isinstance(r, SampleResult) for r in results), results  # valid prompts: no InputError
        return sum(len(s.tokens) for r in results if isinstance(r, SampleResult) for s in r.sequences)

    def compiled() -> int:
        return sum(v.compiles for v in vars(engine).values() if isinstance(v, AotCache)) + sum(
            v.compiles
            for obj in vars(engine).values()
            for v in getattr(obj, "__dict__", {}).values()
            if isinstance(v, AotCache)
        )

    _count_xla_compiles()

    out = {}
    for name, (n, k) in (("single_1x1", (1, 1)), ("concurrent_64x4", (64, 4))):
        run(n, k)
        before, xla_before = compiled(), _XLA_COMPILES[0]
        tokens, t0 = 0, time.perf_counter()
        for _ in range(repeats):
            tokens += run(n, k)
        seconds = time.perf_counter() - t0
        out[name] = {
            "tokens_per_s": round(tokens / seconds, 1),
            "tokens": tokens,
            "seconds": round(seconds, 3),
            "compilations_during_timed_part": compiled() - before,
            "xla_compilations_during_timed_part": _XLA_COMPILES[0] - xla_before,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="measure a running stack (compilations are then not counted)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--moe",
        action="store_true",
        help="instead: the Qwen3-30B-A3B-layer MoE shape, engine vs a "
        "bare jitted decode loop (benchmarks/sample_moe.py)",
    )
    args = parser.parse_args()
    if args.moe:
        from benchmarks.sample_moe import main as moe_main

        moe_main(["--repeats", str(args.repeats)])
        return
    with running_stack(args.base_url, API_KEY) as (base_url, stack):
        sdk, model_dir = sdk_figures(base_url, stack, args.repeats)
        engine = engine_figures(model_dir, args.repeats)
    for path, figures in (("sdk", sdk), ("engine", engine)):
        for name, f in figures.items():
            emit(figure=f"sample_{name}_tokens_per_s", path=path, new_tokens=NEW_TOKENS, **f)
        emit(
            figure="sample_concurrency_speedup",
            path=path,
            ratio=round(figures["concurrent_64x4"]["tokens_per_s"] / figures["single_1x1"]["tokens_per_s"], 2),
        )


if __name__ == "__main__":
    main()
