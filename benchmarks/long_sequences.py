"""Long sequences on the embedded tiny model with 40,960 positions: time and memory against length, through the SDK
and in the engine alone; packing; and the reference attention for contrast.

    python -m benchmarks.long_sequences [--lengths 2048,4096,...] [--skip-sdk] [--reference-lengths 2048,4096]

Figures (one JSON line each; the report plots them):
* `long_sequences_forward_backward_s`: one datum of `tokens` tokens, forward_backward, seconds (the second call of a
  length under 16K, whose first compiles; the first above it, where the compile is a small part).
* `long_sequences_sample_s`: 1 token sampled after a prompt of tokens - 1 tokens (prefill then one decode step), the
  same way; beside it SkyRL tx 0.4.0's figure on this machine and model where one was taken (2K, 8K, 16K).
* `long_sequences_first_sample_s`: the same sample, the first of its length (its compile, if any, included: what a
  user's first prompt of that length meets once the worker's warm-up is done; the engine alone after the same
  warm-up), beside SkyRL tx's figure, which includes its compiles too.
* `long_sequences_memory_gb`: the JAX worker's memory high-water (VmHWM) once that length has trained and sampled,
  against the engine-alone process's (ru_maxrss); both also hold what shorter lengths left behind.
* `long_sequences_reference_attention`: the materialised attention (TINKERFLOW_ATTENTION=reference) at short lengths
  in a fresh process, time and memory, for the curve it replaced.
* `packing_64x50_vs_1x3200`: forward_backward of 64 datums of 50 tokens over one datum of 3,200 tokens (target: within
  1.5x), engine alone and through the SDK.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import emit, emit_pair, wait_for_steady_state

# SkyRL tx 0.4.0, same machine and model, 1-token sample after a prompt this long (seconds).
SKYRL_SAMPLE_S = {2048: 1.5, 8192: 3.1, 16384: 27.0}
POSITIONS = 40960
API_KEY = "tml-bench-long"


def long_model(directory: Path) -> Path:
    from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

    model = make_tiny_model(directory, progress=False)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = POSITIONS
    (model / "config.json").write_text(json.dumps(config, indent=2))
    return model


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 2000, n + 1).astype(np.int32)


def _once(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def engine_figures(model: Path, lengths: list[int]) -> dict[int, dict[str, float]]:
    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, LoraConfig, SampleInput, WarmUpPlan

    engine = Engine.load(str(model), max_lora_adapters=2, max_lora_rank=8, progress=False)
    engine.warm_up(WarmUpPlan().pieces())  # as the stack's worker does before its steady state
    engine.create_adapter(0, LoraConfig(rank=8, seed=0))
    out: dict[int, dict[str, float]] = {}
    for n in lengths:

        def fb_call(seed: int, n: int = n):
            s = tokens(n, seed)
            req = ForwardBackwardInput(slot=0, data=[Datum(s[:-1], {"target_tokens": s[1:]})], loss_fn="cross_entropy")
            return engine.forward_backward([req])

        def sample_call(seed: int, n: int = n):
            return engine.sample([SampleInput(prompt=tokens(n, seed)[: n - 1], max_tokens=1, seed=0)])

        fb = _seconds(fb_call, n)
        first, sm = _first_and_warm(sample_call)
        out[n] = {"fb": fb, "sample": sm, "sample_first": first, "rss_gb": _high_water(os.getpid()) / 2**30}
        print(f"engine {n}: {out[n]}", file=sys.stderr, flush=True)
    out[0] = {"packing": packing_ratio(engine)}
    return out


def _seconds(call, n: int) -> float:
    """Seconds of call(seed): below 16K tokens the second call, on other tokens (the first compiles; a prompt seen
    before would be a prefix-cache hit, another program); from 16K the first, where the compile is a small part."""
    first = _once(lambda: call(1))
    return first if n >= 16384 else _once(lambda: call(2))


def _first_and_warm(call) -> tuple[float, float]:
    """Seconds of the first call of a length (what a user's first prompt of it meets: any compile included) and of
    the next, on other tokens (a prompt seen before would be a prefix-cache hit)."""
    return _once(lambda: call(1)), _once(lambda: call(2))


def packing_ratio(engine) -> float:
    from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput

    def fb(lengths: list[int]):
        data = [Datum(s[:-1], {"target_tokens": s[1:]}) for s in (tokens(m, i) for i, m in enumerate(lengths))]
        return lambda: engine.forward_backward([ForwardBackwardInput(slot=0, data=data, loss_fn="cross_entropy")])

    many, one = fb([50] * 64), fb([3200])
    for f in (many, one):
        f()
    return min(_once(many) for _ in range(3)) / min(_once(one) for _ in range(3))


def sdk_figures(model: Path, lengths: list[int]) -> dict[int, dict[str, float]]:
    import tinker
    from tinker import types

    from tinkerflow.cli.launch import launch

    def datum(s: np.ndarray) -> types.Datum:
        return types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1].tolist()),
            loss_fn_inputs={"target_tokens": s[1:].tolist()},  # pyright: ignore[reportArgumentType]
        )

    out: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="tinkerflow-bench-long-") as d:
        extra = ["--base-model", str(model), "--max-lora-adapters", "2"]
        stack = launch(Path(d) / "state", api_key=API_KEY, extra=extra)
        try:
            # A user's first prompt of a length meets a worker past its warm-up (the whole program set built): what
            # `sample_first` times is whatever that prompt still compiles, which the bounded set makes nothing.
            wait_for_steady_state(stack)
            service = tinker.ServiceClient(base_url=stack.base_url, api_key=API_KEY)
            training = service.create_lora_training_client(base_model=stack.served_model(), rank=8).result()
            sampler = training.save_weights_and_get_sampling_client().result()
            pid = stack.parts()["jax-worker"]["pid"]
            for n in lengths:

                def fb_call(seed: int, n: int = n):
                    return training.forward_backward([datum(tokens(n, seed))], "cross_entropy").result()

                def sample_call(seed: int, n: int = n):
                    prompt = types.ModelInput.from_ints(tokens(n, seed)[: n - 1].tolist())
                    return sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1, seed=0)).result()

                fb = _seconds(fb_call, n)
                first, sm = _first_and_warm(sample_call)
                out[n] = {"fb": fb, "sample": sm, "sample_first": first, "rss_gb": _high_water(pid) / 2**30}
                print(f"sdk {n}: {out[n]}", file=sys.stderr, flush=True)

            def many():
                data = [datum(tokens(50, i)) for i in range(64)]
                return lambda: training.forward_backward(data, "cross_entropy").result()

            one = lambda: training.forward_backward([datum(tokens(3200, 0))], "cross_entropy").result()  # noqa: E731
            f = many()
            f()
            one()
            out[0] = {"packing": min(_once(f) for _ in range(3)) / min(_once(one) for _ in range(3))}
        finally:
            stack.stop()
    return out


def _high_water(pid: int) -> int:
    """VmHWM: the process's own memory high-water (ru_maxrss would carry a parent's across fork and exec)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


REFERENCE = """
import json, sys, time
import numpy as np
from tinkerflow.workers.engine.engine import Engine
from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, LoraConfig
e = Engine.load(sys.argv[1], max_lora_adapters=1, max_lora_rank=8, progress=False)
e.create_adapter(0, LoraConfig(rank=8, seed=0))
n = int(sys.argv[2])
s = np.random.default_rng(n).integers(1, 2000, n + 1).astype(np.int32)
req = ForwardBackwardInput(slot=0, data=[Datum(s[:-1], {"target_tokens": s[1:]})], loss_fn="cross_entropy")
e.forward_backward([req])
t0 = time.perf_counter(); e.forward_backward([req]); dt = time.perf_counter() - t0
hwm = next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmHWM:"))
print(json.dumps({"s": dt, "rss_gb": hwm / 2**20}))
"""


def reference_figures(model: Path, lengths: list[int]) -> None:
    for n in lengths:
        for impl in ("reference", "blockwise"):
            env = dict(os.environ, TINKERFLOW_ATTENTION=impl)
            run = subprocess.run(
                [sys.executable, "-c", REFERENCE, str(model), str(n)],
                env=env,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            if run.returncode != 0:
                emit(figure="long_sequences_reference_attention", tokens=n, attention=impl, error=run.stderr[-500:])
                continue
            got = json.loads(run.stdout.strip().splitlines()[-1])
            emit(
                figure="long_sequences_reference_attention",
                tokens=n,
                attention=impl,
                forward_backward_s=round(got["s"], 3),
                memory_gb=round(got["rss_gb"], 3),
            )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--lengths", default="2048,4096,8192,16384,32768,40960", help="tokens per datum (and prompt + 1 sampled token)"
    )
    parser.add_argument("--reference-lengths", default="2048,4096", help="lengths for the reference attention")
    parser.add_argument("--skip-sdk", action="store_true", help="the engine alone only")
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    with tempfile.TemporaryDirectory(prefix="tinkerflow-long-model-") as d:
        model = long_model(Path(d) / "model")
        engine = engine_figures(model, lengths)
        sdk = {} if args.skip_sdk else sdk_figures(model, lengths)
        reference_figures(model, [int(x) for x in args.reference_lengths.split(",") if x])
    for n in lengths:
        e, s = engine[n], sdk.get(n)
        if s is None:
            emit(figure="long_sequences_forward_backward_s", tokens=n, engine=round(e["fb"], 3), unit="s")
            continue
        emit_pair("long_sequences_forward_backward_s", "s", s["fb"], e["fb"], tokens=n)
        emit_pair("long_sequences_sample_s", "s", s["sample"], e["sample"], tokens=n, skyrl_tx=SKYRL_SAMPLE_S.get(n))
        first_sample = dict(tokens=n, skyrl_tx=SKYRL_SAMPLE_S.get(n))
        emit_pair("long_sequences_first_sample_s", "s", s["sample_first"], e["sample_first"], **first_sample)
        emit_pair("long_sequences_memory_gb", "GB", s["rss_gb"], e["rss_gb"], tokens=n)
    if sdk:
        emit_pair("packing_64x50_vs_1x3200", "×", sdk[0]["packing"], engine[0]["packing"])
    else:
        emit(figure="packing_64x50_vs_1x3200", engine=round(engine[0]["packing"], 3), unit="×")


if __name__ == "__main__":
    main()
