"""The engine alone on one accelerator, in one run of a few minutes: what a first GPU (or TPU) session should learn.

    python -m benchmarks.device_check [--budget-s 480] [--phases env,parity,...] [--out FILE] [--smoke]

Phases in priority order, each printing one JSON line per figure (and one `{"phase": ..., "error": ...}` line when it
fails: a failure on real hardware is a finding, and the next phase still runs); a phase whose estimated time no
longer fits the budget is skipped and says so:

* env: versions, the device, a bf16 matmul's TFLOP/s and a device-to-device copy's GB/s (the measured peaks).
* parity: bf16 against float32 weights (one random model, same draws), whether float32 matmuls run as TF32, GPU
  against CPU in float32, and every attention implementation against the reference with gradients.
* attention: each attention implementation's forward+backward at 8K and 32K tokens, Qwen3-8B's heads.
* train: Qwen3-8B shape (random weights drawn on the device), bf16, 8 adapters of rank 32, gradient checkpointing,
  8 datums x 1,024 tokens: one adapter against eight; tokens/s, mfu_lora and hfu over the datasheet peak (and the
  6·N full fine-tuning figure, named as such: device_phases/flops.py); then 8 tenants of mixed lengths in one engine
  call against one run of the same datums (tenants_ratio). Checkpointing at the levels `--remat` names (comma-
  separated: none, dots, full, or plan, the memory plan's choice by length; default full), each train line naming its
  own (`remat`); `--compute-dtype-residual`: the residual stream between layers in bf16 (`residual`).
* long: the same model's forward_backward of one datum of 8K, 16K and 32K tokens: time (median of 3), peak memory, the
  memory plan's estimate beside it (the plan's admission limit is lifted here to measure past it).
* sample: decode ms per step at 64 and 256 rows (1 and 8 adapters at 256) against the HBM floor (weights less the
  gathered embedding, and the KV read per step, over the copy bandwidth measured in the same process), with each of
  the sampler's layer loops (`decode_layers`: the scan, and unrolled over static slices of the stacked weights), the
  decode program timed alone (device_phases/decode.py).
* agree: the sampler's logprobs of its own tokens against the trainer's forward logprobs of the same sequence.

The 8B phases share one worker process (one model draw); every other phase runs in its own. A worker that dies is
restarted on the phases left after the one it died in. `--smoke` runs every phase on tiny shapes on CPU (CI runs
it). The machine needs only what the engine imports (jax, flax, optax, numpy, safetensors): this script puts the
repository's folders on the import path under the `tinkerflow` name when the package is not installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import traceback
from pathlib import Path

from benchmarks.device_phases import provenance
from benchmarks.device_phases.attention import phase_attention
from benchmarks.device_phases.env import phase_env
from benchmarks.device_phases.measure import Budget, emit
from benchmarks.device_phases.model import ModelPhases
from benchmarks.device_phases.parity import phase_parity
from benchmarks.device_phases.train_levels import REMAT_ENV, RESIDUAL_ENV

REPO = Path(__file__).resolve().parent.parent
PHASES = ("env", "parity", "attention", "train", "long", "sample", "agree")
MODEL_PHASES = ("train", "long", "sample", "agree")  # share one worker and one model
# Seconds each phase needs at least on an H100 (compiles included); a phase is skipped when less is left.
ESTIMATE_S: dict[str, float] = {
    "env": 20,
    "parity": 45,
    "attention": 45,
    "train": 160,  # the tenants' figure compiles its own shapes
    "long": 150,  # 3 timed repetitions a length
    "sample": 150,  # both layer loops' programs, the unrolled one's compile growing with depth
    "agree": 40,
}
SMOKE_ESTIMATE_S: dict[str, float] = dict.fromkeys(PHASES, 5)


def ensure_importable() -> None:
    """`tinkerflow.*` from this checkout when the package is not installed (a bare device machine): a folder of
    links named as pyproject.toml's package-dir maps them."""
    try:
        import tinkerflow.workers.engine.engine  # noqa: F401

        return
    except ImportError:
        pass
    shim = Path(tempfile.gettempdir()) / "tinkerflow-device-check" / "tinkerflow"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "__init__.py").touch()
    package_dir = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, target in package_dir.items():
        link = shim / package.removeprefix("tinkerflow.")
        if not link.exists():
            link.symlink_to(REPO / target)
    sys.path.insert(0, str(shim.parent))
    for mod in [m for m in sys.modules if m == "tinkerflow" or m.startswith("tinkerflow.")]:
        del sys.modules[mod]


PHASE_FUNCTIONS = {"env": phase_env, "parity": phase_parity, "attention": phase_attention}


def run_phases(names: list[str], smoke: bool, budget: Budget, quick: bool = False) -> None:
    """The worker: run `names` in order in this process, one `{"phase_done": name}` line after each."""
    ensure_importable()
    model: ModelPhases | None = None
    for name in names:
        t0 = time.perf_counter()
        try:
            if name in MODEL_PHASES:
                model = model or ModelPhases(smoke, budget, quick)
                try:
                    getattr(model, name)()
                except Exception as e:  # noqa: BLE001 - once more on the portable attention, to learn what broke
                    if os.environ.get("TINKERFLOW_ATTENTION") == "blockwise":
                        raise
                    emit(
                        phase=name,
                        error=f"{type(e).__name__}: {str(e)[:600]}",
                        retry="TINKERFLOW_ATTENTION=blockwise",
                        trace=traceback.format_exc()[-1500:],
                    )
                    os.environ["TINKERFLOW_ATTENTION"] = "blockwise"
                    model.forget_programs()
                    getattr(model, name)()
            else:
                PHASE_FUNCTIONS[name](smoke)
        except Exception as e:  # noqa: BLE001 - reported, and the next phase runs
            emit(phase=name, error=f"{type(e).__name__}: {str(e)[:600]}", trace=traceback.format_exc()[-1500:])
        emit(phase_done=name, seconds=round(time.perf_counter() - t0, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=480.0, help="stop starting phases after this (seconds)")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated, from {', '.join(PHASES)}")
    parser.add_argument("--smoke", action="store_true", help="every phase on tiny shapes on CPU (CI)")
    parser.add_argument("--out", type=Path, help="also write the JSON lines here")
    parser.add_argument("--quick", action="store_true", help="train and sample one layout each (a re-check)")
    parser.add_argument(
        "--remat",
        help="the train phase's gradient-checkpointing levels, comma-separated: none, dots, full (forced) or plan "
        "(the memory plan's choice by length); default full. Each train line names its level",
    )
    parser.add_argument(
        "--compute-dtype-residual",
        action="store_true",
        help="the model phases' engine keeps the residual stream between layers in bf16 (off: float32)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.remat:  # the workers inherit these (device_phases/model.py reads them)
        os.environ[REMAT_ENV] = args.remat
    if args.compute_dtype_residual:
        os.environ[RESIDUAL_ENV] = "1"
    names = [p for p in args.phases.split(",") if p]
    unknown = sorted(set(names) - set(PHASES))
    if unknown:
        parser.error(f"unknown phases {unknown}; choose from {', '.join(PHASES)}")
    budget = Budget(args.budget_s)
    if args.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
    os.environ.setdefault("TINKERFLOW_SAMPLER_EAGER_BUCKETS", "0")  # compile the slot buckets in use only
    if args.worker:
        run_phases(names, args.smoke, budget, args.quick)
        return 0
    out = args.out.open("w") if args.out else None
    estimate = SMOKE_ESTIMATE_S if args.smoke else ESTIMATE_S
    groups = [[n] for n in names if n not in MODEL_PHASES] + [[n for n in names if n in MODEL_PHASES]]
    for group in (g for g in groups if g):
        todo = list(group)
        while todo:
            fits = [n for n in todo if estimate[n] <= budget.left()]
            for n in todo:
                if n not in fits:
                    relay(out, stamped(phase=n, skipped="budget", left_s=round(budget.left())))
            todo = fits
            if todo:
                todo = run_worker(todo, args.smoke, budget, out, args.quick)
    if out is not None:
        out.close()
    return 0


def stamped(**figure) -> str:
    """A line of the parent's own (a skip, a dead worker), stamped as measure.emit stamps the workers' lines."""
    return json.dumps({**figure, **provenance.stamp()}, default=str)


def relay(out, line: str) -> None:
    print(line, flush=True)
    if out is not None:
        out.write(line + "\n")
        out.flush()


def run_worker(todo: list[str], smoke: bool, budget: Budget, out, quick: bool = False) -> list[str]:
    """Run `todo` in one worker process, relaying its lines as they come (so a run cut short keeps what it
    measured); returns the phases left after the one it died in, if it died."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.device_check",
        "--worker",
        "--phases",
        ",".join(todo),
        "--budget-s",
        str(max(1.0, budget.left() - 10)),
    ]
    cmd += (["--smoke"] if smoke else []) + (["--quick"] if quick else [])
    err = tempfile.TemporaryFile("w+")  # noqa: SIM115 (read after the process ends, closed with it)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True)
    timer = threading.Timer(max(1.0, budget.left()), proc.kill)
    timer.start()
    done: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "phase_done" in rec:
            done.append(rec["phase_done"])
        relay(out, line.rstrip("\n"))
    proc.wait()
    timer.cancel()
    left = [n for n in todo if n not in done]
    if not left:
        return []
    err.seek(0)
    relay(out, stamped(phase=left[0], error=f"worker exited {proc.returncode}", stderr=err.read()[-2000:]))
    return left[1:]


if __name__ == "__main__":
    sys.exit(main())
