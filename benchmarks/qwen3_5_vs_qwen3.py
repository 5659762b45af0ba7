"""What the tiny Qwen3.5 costs against a tiny Qwen3 of the same width and depth (benchmarks/same_width.py), through
the SDK against `tinkerflow up` and the engine alone on the same workload in the same run.

    python -m benchmarks.qwen3_5_vs_qwen3 [--tokens 8192] [--calls 128] [--repeats 3]

Workloads (each once untimed, its compile, then --repeats timed; the median):
* forward_backward of one datum of --tokens tokens (target: Qwen3.5 at most 1.5x Qwen3);
* sampling: --calls concurrent calls of 4 samples x 32 tokens after short distinct prompts (target: within 1.3x).

Figures (one JSON line each, with the load average before and after): `qwen3_5_vs_qwen3_forward_backward_s` and
`qwen3_5_vs_qwen3_sample_s` per family (tinkerflow beside the engine alone), then `qwen3_5_vs_qwen3_ratio` per
workload: Qwen3.5's time over Qwen3's, through the SDK and in the engine alone, with the target.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.common import emit, emit_pair
from benchmarks.same_width import FAMILIES, tiny_model
from benchmarks.sample_sweep import NEW_TOKENS, SAMPLES, prompt_ids

API_KEY = "tml-bench-qwen3-5-vs-qwen3"
TARGETS = {"forward_backward": 1.5, "sample": 1.3}


def _timed(call: Callable[[], object], repeats: int) -> dict:
    """The first call (its compile) apart, then the median of `repeats` more, with the load around them."""
    load_before = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    call()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    load_after = [round(x, 2) for x in os.getloadavg()]
    return {"s": statistics.median(times), "first_s": first, "load_before": load_before, "load_after": load_after}


def _datum_tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 2000, n + 1).astype(np.int32)


def sdk_figures(model: Path, n_tokens: int, calls: int, repeats: int) -> dict[str, dict]:
    import tinker
    from tinker import types

    from tinkerflow.cli.launch import launch

    with tempfile.TemporaryDirectory(prefix="tinkerflow-bench-families-") as d:
        extra = ["--base-model", str(model), "--max-lora-adapters", "2", "--warm-up", "off"]
        stack = launch(Path(d) / "state", api_key=API_KEY, extra=extra)
        try:
            # Closed before the stack stops: an open session would go on heartbeating a stopped service.
            with tinker.ServiceClient(base_url=stack.base_url, api_key=API_KEY) as service:
                training = service.create_lora_training_client(base_model=stack.served_model(), rank=8).result()
                sampler = training.save_weights_and_get_sampling_client().result()
                s = _datum_tokens(n_tokens, 0).tolist()
                datum = types.Datum(
                    model_input=types.ModelInput.from_ints(s[:-1]),
                    loss_fn_inputs={"target_tokens": s[1:]},  # pyright: ignore[reportArgumentType]
                )
                params = types.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, stop=[])

                def sample_round() -> None:
                    futures = [
                        sampler.sample(types.ModelInput.from_ints(prompt_ids(i)), SAMPLES, params) for i in range(calls)
                    ]
                    for f in futures:
                        f.result()

                return {
                    "forward_backward": _timed(
                        lambda: training.forward_backward([datum], "cross_entropy").result(), repeats
                    ),
                    "sample": _timed(sample_round, repeats),
                }
        finally:
            stack.stop()


def engine_figures(model: Path, n_tokens: int, calls: int, repeats: int) -> dict[str, dict]:
    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, LoraConfig, SampleInput

    engine = Engine.load(str(model), max_lora_adapters=2, max_lora_rank=8, progress=False)
    engine.create_adapter(0, LoraConfig(rank=8, seed=0))
    engine.snapshot(0, "bench")
    s = _datum_tokens(n_tokens, 0)
    fb = ForwardBackwardInput(slot=0, data=[Datum(s[:-1], {"target_tokens": s[1:]})], loss_fn="cross_entropy")
    requests = [
        SampleInput(
            prompt=np.asarray(prompt_ids(i), np.int32),
            num_samples=SAMPLES,
            max_tokens=NEW_TOKENS,
            stop_token_ids=[],
            snapshot="bench",
        )
        for i in range(calls)
    ]
    return {
        "forward_backward": _timed(lambda: engine.forward_backward([fb]), repeats),
        "sample": _timed(lambda: engine.sample(requests), repeats),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the forward_backward datum")
    parser.add_argument("--calls", type=int, default=128, help="concurrent sample calls of 4 x 32 tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each workload after the first")
    args = parser.parse_args(argv)
    got: dict[str, dict[str, dict[str, dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="tinkerflow-family-models-") as d:
        for family in FAMILIES:
            model = tiny_model(family, Path(d), max(args.tokens + 1, 2048))
            got[family] = {
                "sdk": sdk_figures(model, args.tokens, args.calls, args.repeats),
                "engine": engine_figures(model, args.tokens, args.calls, args.repeats),
            }
            print(f"{family}: {got[family]}", file=sys.stderr, flush=True)
    shape = {"forward_backward": {"tokens": args.tokens}, "sample": {"calls": args.calls, "samples": SAMPLES}}
    for workload, where in shape.items():
        for family in FAMILIES:
            s, e = got[family]["sdk"][workload], got[family]["engine"][workload]
            emit_pair(
                f"qwen3_5_vs_qwen3_{workload}_s",
                "s",
                s["s"],
                e["s"],
                family=family,
                first_s=round(s["first_s"], 3),
                engine_first_s=round(e["first_s"], 3),
                load_before=s["load_before"],
                load_after=e["load_after"],
                **where,
            )
        ratio = {k: got["qwen3_5"][k][workload]["s"] / got["qwen3"][k][workload]["s"] for k in ("sdk", "engine")}
        emit(
            figure="qwen3_5_vs_qwen3_ratio",
            workload=workload,
            tinkerflow=round(ratio["sdk"], 3),
            engine=round(ratio["engine"], 3),
            target=TARGETS[workload],
            met=ratio["sdk"] <= TARGETS[workload],
            load=[round(x, 2) for x in os.getloadavg()],
            **where,
        )


if __name__ == "__main__":
    main()
