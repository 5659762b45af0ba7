"""Qwen3.5's long context beside Qwen3's: time and memory against length through the SDK against `tinkerflow up`, on
the tiny Qwen3.5 and a tiny Qwen3 of the same width and depth (benchmarks/same_width.py), both allowing 65,536
positions, and the engine alone on the same workload in the same run.

    python -m benchmarks.long_sequences_qwen3_5 [--families qwen3,qwen3_5] [--lengths 2048,...,65536]
        [--train-up-to 32768] [--skip-engine] [--plot docs/benchmarks-long-sequences-qwen3_5.png]

At each length: forward_backward of one datum of that many tokens (up to --train-up-to), and a 1-token sample after
a prompt of length - 1 tokens (prefill, then one decode step). Each is timed twice on other tokens: `first_s`, the
first call of that length (its compile included: the stack runs with `--warm-up off`, so what a length compiles
shows there), and `warm_s`, the next. Then the memory high-water (VmHWM) of the JAX worker (of the engine-alone
process beside it), which also holds what the shorter lengths left behind.

Figures (one JSON line each, with the load average before and after the length):
* `long_sequences_qwen3_5_forward_backward_s` (family, tokens): tinkerflow = warm_s through the SDK, engine = the same
  alone; first_s of each beside.
* `long_sequences_qwen3_5_sample_s` (family, tokens): the same for the 1-token sample.
* `long_sequences_qwen3_5_memory_gb` (family, tokens): the JAX worker's high-water, the engine-alone process's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks.common import emit
from benchmarks.same_width import FAMILIES, tiny_model

POSITIONS = 65536
API_KEY = "tml-bench-long-qwen3-5"
PLOT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks-long-sequences-qwen3_5.png"
#: Per (family, tokens): {"fb": (first_s, warm_s), "sample": (first_s, warm_s), "rss_gb": GB, "load": [...]}
Figures = dict[tuple[str, int], dict]


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 2000, n).astype(np.int32)


def _seconds(call: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def _first_and_warm(call: Callable[[int], object]) -> tuple[float, float]:
    """The first call of a length and the next, on other tokens (a prompt seen before would hit the prefix cache)."""
    return _seconds(lambda: call(1)), _seconds(lambda: call(2))


def high_water_gb(pid: int) -> float:
    """VmHWM: the process's own high-water (ru_maxrss would carry a parent's across fork and exec)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return 0.0


def _measure(fb, sample, lengths: list[int], train_up_to: int, pid: int, label: str) -> dict[int, dict]:
    """fb(seed, n) and sample(seed, n) at each length; the process `pid`'s high-water after each."""
    out: dict[int, dict] = {}
    for n in lengths:
        load = [round(x, 2) for x in os.getloadavg()]
        row: dict = {"load_before": load}
        if n <= train_up_to:
            row["fb"] = _first_and_warm(lambda seed, n=n: fb(seed, n))
        row["sample"] = _first_and_warm(lambda seed, n=n: sample(seed, n))
        row["rss_gb"] = high_water_gb(pid)
        row["load_after"] = [round(x, 2) for x in os.getloadavg()]
        out[n] = row
        print(f"{label} {n}: {row}", file=sys.stderr, flush=True)
    return out


def engine_figures(model: Path, lengths: list[int], train_up_to: int) -> dict[int, dict]:
    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.types import Datum, ForwardBackwardInput, LoraConfig, SampleInput

    engine = Engine.load(str(model), max_lora_adapters=2, max_lora_rank=8, progress=False)
    engine.create_adapter(0, LoraConfig(rank=8, seed=0))

    def fb(seed: int, n: int):
        s = tokens(n + 1, seed)
        req = ForwardBackwardInput(slot=0, data=[Datum(s[:-1], {"target_tokens": s[1:]})], loss_fn="cross_entropy")
        return engine.forward_backward([req])

    def sample(seed: int, n: int):
        return engine.sample([SampleInput(prompt=tokens(n - 1, seed), max_tokens=1, seed=0)])

    return _measure(fb, sample, lengths, train_up_to, os.getpid(), f"engine {model.name}")


def engine_alone(model: Path, lengths: str, train_up_to: int) -> dict[int, dict]:
    """engine_figures in a fresh process, so its high-water is that family's alone."""
    argv = ["--lengths", lengths, "--train-up-to", str(train_up_to), "--engine-alone", str(model)]
    run = subprocess.run([sys.executable, "-m", "benchmarks.long_sequences_qwen3_5", *argv], stdout=subprocess.PIPE)
    run.check_returncode()
    return {int(n): row for n, row in json.loads(run.stdout.decode().strip().splitlines()[-1]).items()}


def sdk_figures(model: Path, lengths: list[int], train_up_to: int) -> dict[int, dict]:
    import tinker
    from tinker import types

    from tinkerflow.cli.launch import launch

    with tempfile.TemporaryDirectory(prefix="tinkerflow-bench-long-") as d:
        extra = ["--base-model", str(model), "--max-lora-adapters", "2", "--warm-up", "off"]
        stack = launch(Path(d) / "state", api_key=API_KEY, extra=extra)
        try:
            # Closed before the stack stops: an open session would go on heartbeating a stopped service.
            with tinker.ServiceClient(base_url=stack.base_url, api_key=API_KEY) as service:
                training = service.create_lora_training_client(base_model=stack.served_model(), rank=8).result()
                sampler = training.save_weights_and_get_sampling_client().result()

                def fb(seed: int, n: int):
                    s = tokens(n + 1, seed).tolist()
                    datum = types.Datum(
                        model_input=types.ModelInput.from_ints(s[:-1]),
                        loss_fn_inputs={"target_tokens": s[1:]},  # pyright: ignore[reportArgumentType]
                    )
                    return training.forward_backward([datum], "cross_entropy").result()

                def sample(seed: int, n: int):
                    prompt = types.ModelInput.from_ints(tokens(n - 1, seed).tolist())
                    return sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1, seed=0)).result()

                pid = stack.parts()["jax-worker"]["pid"]
                return _measure(fb, sample, lengths, train_up_to, pid, f"sdk {model.name}")
        finally:
            stack.stop()


def emit_figures(family: str, sdk: dict[int, dict], engine: dict[int, dict]) -> None:
    for n, s in sdk.items():
        e = engine.get(n, {})
        where = dict(family=family, tokens=n, load_before=s["load_before"], load_after=s["load_after"])
        for key, figure in (("fb", "forward_backward_s"), ("sample", "sample_s")):
            if key not in s:
                continue
            (first, warm), alone = s[key], e.get(key)
            emit(
                figure=f"long_sequences_qwen3_5_{figure}",
                unit="s",
                tinkerflow=round(warm, 3),
                engine=None if alone is None else round(alone[1], 3),
                ratio=None if alone is None else round(warm / alone[1], 3),
                first_s=round(first, 3),
                engine_first_s=None if alone is None else round(alone[0], 3),
                **where,
            )
        emit(
            figure="long_sequences_qwen3_5_memory_gb",
            unit="GB",
            tinkerflow=round(s["rss_gb"], 3),
            engine=round(e["rss_gb"], 3) if e else None,
            **where,
        )


def plot(figures: dict[str, dict[int, dict]], path: Path) -> None:
    """Time (warm and first) and the JAX worker's high-water against length, one colour per family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (family, rows), colour in zip(figures.items(), ("tab:blue", "tab:orange"), strict=False):
        lengths = sorted(rows)
        for key, what, marker in (("fb", "forward_backward", "o"), ("sample", "1-token sample", "s")):
            xs = [n for n in lengths if key in rows[n]]
            warm = [rows[n][key][1] for n in xs]
            first = [rows[n][key][0] for n in xs]
            ax_time.plot(xs, warm, marker=marker, color=colour, label=f"{family}: {what}, warm")
            ax_time.plot(xs, first, marker=marker, color=colour, linestyle=":", alpha=0.6, label=f"{family}: first")
        ax_mem.plot(lengths, [rows[n]["rss_gb"] for n in lengths], marker="o", color=colour, label=family)
    ax_mem.axhline(4.0, color="grey", linestyle="--", label="4 GB")
    for ax, ylabel in ((ax_time, "seconds (through the SDK)"), (ax_mem, "JAX worker high-water, GB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax_time.set_yscale("log")
    fig.suptitle("Tiny Qwen3.5 (3 Gated DeltaNet + 1 attention layer) vs tiny Qwen3 of the same width (hidden 96, 4)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--lengths", default="2048,4096,8192,16384,32768,65536")
    parser.add_argument("--train-up-to", type=int, default=32768, help="the longest forward_backward")
    parser.add_argument("--skip-engine", action="store_true", help="through the SDK only (no engine-alone column)")
    parser.add_argument("--plot", default=str(PLOT), help="where the PNG goes ('' for none)")
    parser.add_argument("--engine-alone", type=Path, help=argparse.SUPPRESS)  # the engine-alone child (below)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if args.engine_alone:
        print(json.dumps(engine_figures(args.engine_alone, lengths, args.train_up_to)))
        return
    sdk: dict[str, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="tinkerflow-long-models-") as d:
        for family in args.families.split(","):
            model = tiny_model(family, Path(d), POSITIONS)
            sdk[family] = sdk_figures(model, lengths, args.train_up_to)
            engine = {} if args.skip_engine else engine_alone(model, args.lengths, args.train_up_to)
            emit_figures(family, sdk[family], engine)
    if args.plot:
        plot(sdk, Path(args.plot))


if __name__ == "__main__":
    main()
