"""The prefix KV cache: a GRPO group (16 samples of one prompt) and a multi-turn conversation (each turn's prompt
is the last one plus a reply and a new message), with the cache on and off, in the engine alone and through the SDK
(HTTP → Temporal → coordinator → JAX worker, the cache always on there), in one run. One JSON line per figure:
wall time of the workload (median of --repeats), `hit_tokens` (the responses' `prompt_cache_hit_tokens`, summed over
the workload's calls: the first sample's prompt tokens from the cache, so 0 for a cold group whose later samples are
the ones that hit) and, in the engine alone, `served_tokens` (every sample's prompt tokens from the cache). A stack
it launches is measured at its steady state (after the JAX worker's background warm-up), and the JAX worker's
compiles during the timed runs are counted (each workload's shapes are compiled by an untimed first run).

    python -m benchmarks.prefix_cache [--base-url URL] [--repeats N] [--engine-only]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import numpy as np

from benchmarks.common import emit, emit_pair, median, running_stack, wait_for_steady_state, worker_compiles

API_KEY = "tml-bench-key"
GROUP, PROMPT_LEN, NEW_TOKENS = 16, 480, 16
TURNS, TURN_TOKENS = 6, 64


def _prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(10, min(vocab, 2000), n).tolist()


def _conversation(rng, vocab: int) -> list[list[int]]:
    """Turn t's prompt: turn t-1's, its reply (stand-in tokens), and a new message."""
    turns, prompt = [], _prompt(rng, TURN_TOKENS, vocab)
    for _ in range(TURNS):
        turns.append(list(prompt))
        prompt = prompt + _prompt(rng, NEW_TOKENS + TURN_TOKENS, vocab)
    return turns


def engine_figures(model_dir: str, repeats: int) -> dict[str, dict]:
    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.types import SampleInput

    engine = Engine.load(model_dir, max_lora_adapters=2, max_lora_rank=8, progress=False)
    vocab = engine.info.vocab_size
    out: dict[str, dict] = {}
    for cache in (False, True):
        index = engine.sampler.pool() and engine.sampler.prefix
        if not cache:
            engine.sampler.prefix = None
        rng = np.random.default_rng(0)

        def group(ns: str, rng=rng) -> int:
            p = np.array(_prompt(rng, PROMPT_LEN, vocab), np.int32)
            [r] = engine.sample(
                [
                    SampleInput(
                        prompt=p,
                        num_samples=GROUP,
                        max_tokens=NEW_TOKENS,
                        stop_token_ids=[],
                        seed=1,
                        cache_namespace=ns,
                    )
                ]
            )
            assert not isinstance(r, Exception), r
            return r.prompt_cache_hit_tokens

        def conversation(ns: str, rng=rng) -> int:
            hits = 0
            for p in _conversation(rng, vocab):
                [r] = engine.sample(
                    [
                        SampleInput(
                            prompt=np.array(p, np.int32),
                            max_tokens=NEW_TOKENS,
                            seed=1,
                            stop_token_ids=[],
                            cache_namespace=ns,
                        )
                    ]
                )
                assert not isinstance(r, Exception), r
                hits += r.prompt_cache_hit_tokens
            return hits

        for name, fn in (("group16", group), ("conversation6", conversation)):
            fn("warm")  # compiles this workload's shapes
            times, hits, served = [], 0, 0
            for i in range(repeats):
                before = index.hits if index is not None else 0
                t0 = time.perf_counter()
                hits = fn(f"{name}-{cache}-{i}")
                times.append((time.perf_counter() - t0) * 1000)
                served = (index.hits if index is not None else 0) - before
            out[f"{name}/{'on' if cache else 'off'}"] = {
                "ms": median(times),
                "hit_tokens": hits,
                "served_tokens": served,
            }
        engine.sampler.prefix = index
    return out


def sdk_figures(base_url: str, repeats: int, stack=None) -> dict[str, dict]:
    import tinker
    from tinker import types

    from benchmarks.common import served_model

    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    base = served_model(base_url, API_KEY)
    vocab = 2048
    rng = np.random.default_rng(0)
    params = types.SamplingParams(max_tokens=NEW_TOKENS, stop=[], seed=1)
    out: dict[str, dict] = {}

    def group(sampler) -> int:
        p = types.ModelInput.from_ints(_prompt(rng, PROMPT_LEN, vocab))
        return sampler.sample(p, GROUP, params).result().prompt_cache_hit_tokens

    def conversation(sampler) -> int:
        return sum(
            sampler.sample(types.ModelInput.from_ints(p), 1, params).result().prompt_cache_hit_tokens
            for p in _conversation(rng, vocab)
        )

    for name, fn in (("group16", group), ("conversation6", conversation)):
        fn(service.create_sampling_client(base_model=base).result())
        times, hits, compiled = [], 0, 0
        for _ in range(repeats):
            # A fresh sampling session (a cold cache), made before the clock starts.
            sampler = service.create_sampling_client(base_model=base).result()
            before = worker_compiles(stack)
            t0 = time.perf_counter()
            hits = fn(sampler)
            times.append((time.perf_counter() - t0) * 1000)
            after = worker_compiles(stack)
            compiled += (after - before) if after is not None and before is not None else 0
        out[name] = {"ms": median(times), "hit_tokens": hits, "compiles": compiled if stack is not None else None}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="a running stack (default: launch one on free ports)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per workload (median reported)")
    parser.add_argument("--engine-only", action="store_true", help="skip the SDK half (no stack)")
    args = parser.parse_args()
    from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

    model_dir = str(make_tiny_model(os.path.expanduser("~/.cache/tinkerflow/bench-tiny")))
    engine = engine_figures(model_dir, args.repeats)
    for name in ("group16", "conversation6"):
        on, off = engine[f"{name}/on"], engine[f"{name}/off"]
        speedup = round(off["ms"] / on["ms"], 2)
        emit(
            figure=f"prefix_cache_{name}_engine",
            unit="ms",
            cache_on=round(on["ms"], 1),
            cache_off=round(off["ms"], 1),
            speedup=speedup,
            hit_tokens=on["hit_tokens"],
            served_tokens=on["served_tokens"],
        )
    if args.engine_only:
        return
    with running_stack(args.base_url, API_KEY) as (base_url, stack):
        waited = wait_for_steady_state(stack)
        sdk = sdk_figures(base_url, args.repeats, stack)
    for name in ("group16", "conversation6"):
        off = round(engine[f"{name}/off"]["ms"], 1)
        emit_pair(
            f"prefix_cache_{name}",
            "ms",
            sdk[name]["ms"],
            engine[f"{name}/on"]["ms"],
            engine_cache_off=off,
            hit_tokens=sdk[name]["hit_tokens"],
            warm_up_wait_s=waited,
            compilations_during_timed_part=sdk[name]["compiles"],
        )


if __name__ == "__main__":
    main()
