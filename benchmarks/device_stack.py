"""The whole stack on one machine against the engine alone, same workload, same run: what the service costs.

    python -m benchmarks.device_stack [--base-model DIR | --shape qwen3-8b] [--concurrency 8] [--no-rl] [--smoke]

`tinkerflow up` (Temporal dev server, API, workflow worker, JAX worker) serves `--base-model` (default: the embedded
tiny model; a directory without safetensors is served with `--random-weights`, its weights drawn on the device), or
`--shape`'s config-only directory (Qwen3-8B's config.json beside the tiny model's tokenizer: no checkpoint needed),
driven by the unmodified `tinker` SDK:

* forward_backward tokens/s: one training client, `rows` datums of `tokens` random tokens, cross entropy; the
  median of the timed repetitions after a compiling one.
* sampling tokens/s: `--concurrency` sample calls in flight at once on one sampling client, `max_tokens` each,
  never stopping early (stop=[]), so both sides produce the same tokens.

* the cookbook's math_rl loop (arithmetic env), run as a user runs the recipe: its step time as the recipe logs
  it, the first step (which compiles) beside the median of the others (`--no-rl` skips it).

Then the stack stops (on an accelerator both could not hold the model at once) and the engine loads the same model
directory in this process and runs the same two workloads (one ForwardBackwardInput; the concurrent calls as one
engine.sample of that many rows, which is what the worker batches them into at best). Each figure is one JSON line
with both values and `service_over_engine` (the stack's rate over the engine's: 1.0 is no cost). `--smoke` runs
it on CPU on the tiny model (tests/benchmarks/test_device_stack.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

from benchmarks.device_stack_parts import config_only_model, has_weights, math_rl_step_times, shapes

API_KEY = "tml-device-stack"


def workload(smoke: bool, concurrency: int) -> dict:
    if smoke:
        return {"rows": 4, "tokens": 64, "repeats": 2, "concurrency": concurrency, "prompt": 16, "max_tokens": 16}
    return {"rows": 8, "tokens": 1024, "repeats": 3, "concurrency": concurrency, "prompt": 64, "max_tokens": 128}


def token_rows(w: dict, seed: int = 0) -> list[tuple[list[int], list[int], list[float]]]:
    """(model_input, target_tokens, weights) of random ids below 256 (valid in every vocabulary served here)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(w["rows"]):
        t = rng.integers(1, 256, w["tokens"] + 1).tolist()
        out.append((t[:-1], t[1:], [1.0] * w["tokens"]))
    return out


def prompt_ids(w: dict) -> list[int]:
    return list(range(1, w["prompt"] + 1))


def through_service(base_url: str, w: dict, rows) -> dict:
    import tinker
    from tinker import types

    from benchmarks.common import sampler_of, sdk_datums, served_model

    service = tinker.ServiceClient(base_url=base_url, api_key=API_KEY)
    training = service.create_lora_training_client(base_model=served_model(base_url, API_KEY), rank=32).result()
    batch = sdk_datums(rows)
    fb = []
    for _ in range(w["repeats"] + 1):  # the first compiles
        t0 = time.perf_counter()
        training.forward_backward(batch, "cross_entropy").result()
        fb.append(time.perf_counter() - t0)
    sampler = sampler_of(training)
    prompt = types.ModelInput.from_ints(prompt_ids(w))
    params = types.SamplingParams(max_tokens=w["max_tokens"], temperature=1.0, stop=[])

    def round_of_calls() -> tuple[float, int]:
        t0 = time.perf_counter()
        futures = [sampler.sample(prompt, 1, params) for _ in range(w["concurrency"])]
        tokens = sum(len(s.tokens) for f in futures for s in f.result().sequences)
        return time.perf_counter() - t0, tokens

    rounds = [round_of_calls() for _ in range(w["repeats"] + 1)]  # the first compiles
    return {"fb_s": fb[1:], "sample": rounds[1:]}


def engine_alone(model_dir: str, w: dict, rows, random_weights: bool) -> dict:
    import numpy as np

    from benchmarks.common import engine_datums
    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.types import ForwardBackwardInput, LoraConfig, SampleInput

    engine = Engine.load(
        model_dir, max_lora_adapters=8, max_lora_rank=32, progress=False, random_weights=random_weights
    )
    engine.create_adapter(0, LoraConfig(rank=32))
    request = [ForwardBackwardInput(0, engine_datums(rows), "cross_entropy")]
    fb = []
    for _ in range(w["repeats"] + 1):
        t0 = time.perf_counter()
        engine.forward_backward(request)
        fb.append(time.perf_counter() - t0)
    engine.snapshot(0, "s")
    prompt = np.asarray(prompt_ids(w), np.int32)
    reqs = [
        SampleInput(prompt=prompt, max_tokens=w["max_tokens"], seed=i, stop_token_ids=[], snapshot="s")
        for i in range(w["concurrency"])
    ]

    def one_call() -> tuple[float, int]:
        t0 = time.perf_counter()
        res = engine.sample(reqs)
        return time.perf_counter() - t0, sum(len(s.tokens) for r in res for s in getattr(r, "sequences", []))

    rounds = [one_call() for _ in range(w["repeats"] + 1)]
    return {"fb_s": fb[1:], "sample": rounds[1:]}


def rates(side: dict, w: dict) -> dict:
    fb = w["rows"] * w["tokens"] / statistics.median(side["fb_s"])
    sample = statistics.median(tokens / s for s, tokens in side["sample"])
    return {"forward_backward_tokens_per_s": fb, "sample_tokens_per_s": sample}


def tiny_model(root: Path) -> Path:
    from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

    return make_tiny_model(root / "model", progress=False)


def model_dir_of(args: argparse.Namespace, root: Path) -> str:
    if args.shape:
        return str(config_only_model(root, args.shape))
    return args.base_model or str(tiny_model(root))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-model", help="model directory the stack serves (default: the embedded tiny model)")
    parser.add_argument(
        "--shape",
        choices=sorted(shapes()),
        help="serve a config-only directory of this shape with random weights (qwen3-8b; tiny: the random-weights "
        "path on the tiny model)",
    )
    parser.add_argument("--concurrency", type=int, default=8, help="sample calls in flight at once")
    parser.add_argument("--no-rl", action="store_true", help="skip the cookbook's math_rl step time")
    parser.add_argument("--rl-timeout-s", type=float, default=240.0, help="the math_rl run's limit")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU (CI)")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    from benchmarks.common import running_stack, served_model
    from benchmarks.device_phases.measure import emit

    w = workload(args.smoke, args.concurrency)
    rows = token_rows(w)
    with tempfile.TemporaryDirectory(prefix="device-stack-") as d:
        model_dir = model_dir_of(args, Path(d))  # outlives the stack: the engine loads it after
        random_weights = not has_weights(model_dir)
        flags = ["--warm-up", "off", "--base-model", model_dir] + (["--random-weights"] if random_weights else [])
        with running_stack(None, API_KEY, flags) as (base_url, _stack):
            service = through_service(base_url, w, rows)
            if not args.no_rl:
                model = served_model(base_url, API_KEY)
                rl = math_rl_step_times(base_url, API_KEY, model, smoke=args.smoke, timeout_s=args.rl_timeout_s)
                emit(phase="stack", figure="math_rl_step_s", weights="random" if random_weights else "checkpoint", **rl)
        engine = engine_alone(model_dir, w, rows, random_weights)
    through, alone = rates(service, w), rates(engine, w)
    for figure, value in through.items():
        emit(
            phase="stack",
            figure=figure,
            weights="random" if random_weights else "checkpoint",
            service=round(value, 1),
            engine=round(alone[figure], 1),
            service_over_engine=round(value / alone[figure], 3) if alone[figure] else None,
            workload=w,
            service_runs_s=[round(s, 4) for s in service["fb_s"]]
            if figure.startswith("forward")
            else [[round(s, 4), n] for s, n in service["sample"]],
            engine_runs_s=[round(s, 4) for s in engine["fb_s"]]
            if figure.startswith("forward")
            else [[round(s, 4), n] for s, n in engine["sample"]],
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
