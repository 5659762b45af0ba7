"""Cold start: `tinkerflow up` until healthy, then the first answers a new user waits for: creating a
rank-8 run, the first forward_backward (8 datums), the first optim_step, the first sample (1 x 16 tokens, on the
sampler of a fresh save_weights_and_get_sampling_client) and the sample right after it (another prompt: whatever
the background warm-up is compiling then must not be in its way); then the steady state: from `up` until the
background warm-up has built the whole program set and a further QUIET_S passed with no compile (`steady_s`),
sampling every few seconds meanwhile (`slowest_sample_until_steady_s`: what a user sampling through the warm-up
waits at worst). Twice: a first start on an empty state dir (so an empty XLA compilation cache: it lives in the
state dir), then a restart of `up` on the same state dir.

The engine alone does the same in a fresh process each time (`--engine-child`): Engine.load, the same first
forward_backward / optim_step / sample, then the whole warm-up plan (its `steady_s`), with the persistent
compilation cache in a directory that is empty the first time and kept for the second. `up` to healthy is set
beside Engine.load (the stack loads the same model, then starts its other parts around it).

    python -m benchmarks.cold_start [--keep DIR] [--logs DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

from benchmarks.common import (
    cycle_rows,
    emit_pair,
    engine_datums,
    jax_worker_log,
    pig_latin_examples,
    programs_built,
    sampler_of,
    sdk_datums,
)

API_KEY = "tml-bench-key"
FIGURES = (
    "up_to_healthy_s",
    "create_run_s",
    "first_forward_backward_s",
    "first_optim_step_s",
    "first_sample_s",
    "second_sample_s",
    "steady_s",
    "slowest_sample_until_steady_s",
)
# The steady state: this long with no program compiled, after the background warm-up said it was done.
QUIET_S = 60.0


def stack_start(state_dir: Path) -> tuple[dict, str]:
    import tinker
    from tinker import types

    from tinkerflow.cli.launch import launch

    built_before = programs_built(state_dir)  # the log is appended across starts
    t0 = time.perf_counter()
    stack = launch(state_dir, api_key=API_KEY)
    out = {"up_to_healthy_s": time.perf_counter() - t0}
    try:
        service = tinker.ServiceClient(base_url=stack.base_url, api_key=API_KEY)

        def timed(name: str, fn):
            t0 = time.perf_counter()
            result = fn()
            out[name] = time.perf_counter() - t0
            return result

        training = timed(
            "create_run_s",
            lambda: service.create_lora_training_client(base_model=stack.served_model(), rank=8).result(timeout=900),
        )
        eight = sdk_datums(cycle_rows(pig_latin_examples(training.get_tokenizer()), 8))
        timed("first_forward_backward_s", lambda: training.forward_backward(eight, "cross_entropy").result(timeout=900))
        timed(
            "first_optim_step_s", lambda: training.optim_step(types.AdamParams(learning_rate=1e-4)).result(timeout=900)
        )
        sampler = sampler_of(training)
        params = types.SamplingParams(max_tokens=16, temperature=1.0, stop=[])
        for name, prompt in (("first_sample_s", [1, 2, 3, 4]), ("second_sample_s", [5, 6, 7, 8])):
            timed(
                name,
                lambda prompt=prompt: sampler.sample(
                    types.ModelInput.from_ints(prompt), num_samples=1, sampling_params=params
                ).result(timeout=900),
            )
        model_dir = training.get_info().model_data.tokenizer_id
        assert model_dir is not None

        def one_sample(i: int):
            prompt = types.ModelInput.from_ints([9 + i % 50, 10, 11])
            return sampler.sample(prompt, num_samples=1, sampling_params=params).result(timeout=900)

        out.update(_until_steady(state_dir, t0, one_sample))
        out["programs_built"] = programs_built(state_dir) - built_before
        out.update(_xla_cache_at_ready(state_dir))
    finally:
        stack.stop()
    return out, model_dir


def _until_steady(state_dir: Path, t0: float, sample, timeout_s: float = 1800.0) -> dict:
    """Sample every few seconds until the background warm-up is done and QUIET_S passed with no compile: `steady_s`
    (from `t0`: the `up`, to the last compile before the quiet), the slowest of those samples, and the programs
    compiled during the quiet (0 in a steady state)."""
    slowest, i, done_at, compiled = 0.0, 0, None, programs_built(state_dir)
    last_compile = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        s0 = time.perf_counter()
        sample(i)
        slowest, i = max(slowest, time.perf_counter() - s0), i + 1
        now = programs_built(state_dir)
        if now != compiled:
            compiled, last_compile = now, time.perf_counter()
        text = jax_worker_log(state_dir)
        if done_at is None and ("background warm-up done" in text or ", 0 after" in text):
            done_at = time.perf_counter()
        if done_at is not None and time.perf_counter() - last_compile >= QUIET_S:
            return {
                "steady_s": last_compile - t0,
                "slowest_sample_until_steady_s": slowest,
                "samples_until_steady": i,
            }
        time.sleep(3.0)
    raise TimeoutError(f"no steady state within {timeout_s:.0f} s: see {state_dir / 'logs'}")


def _xla_cache_at_ready(state_dir: Path) -> dict:
    """What the JAX worker logged when it registered (this start's line is the last): XLA programs read back from
    the state dir's persistent cache and compiled, before it was ready."""
    found = re.findall(r"(\d+) programs read back, (\d+) compiled so far", jax_worker_log(state_dir))
    if not found:
        return {}
    hits, misses = found[-1]
    return {"xla_programs_read_back_before_ready": int(hits), "xla_programs_compiled_before_ready": int(misses)}


def _copy_logs(state_dir: Path, to: Path) -> None:
    to.mkdir(parents=True, exist_ok=True)
    for log in [state_dir / "up.log", *sorted((state_dir / "logs").glob("*.log"))]:
        if log.exists():
            shutil.copyfile(log, to / log.name)


def engine_child(model_dir: str, cache_dir: str) -> None:
    """In a fresh process: Engine.load and the first answers, with the compilation cache at cache_dir."""
    import numpy as np
    from transformers import AutoTokenizer

    from tinkerflow.workers.engine.runtime import persistent_cache

    persistent_cache.enable(Path(cache_dir))
    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.types import AdamConfig, ForwardBackwardInput, LoraConfig, SampleInput, WarmUpPlan

    out = {}
    t0 = start = time.perf_counter()
    engine = Engine.load(model_dir, max_lora_adapters=8, max_lora_rank=32, progress=False)
    out["up_to_healthy_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.create_adapter(0, LoraConfig(rank=8))
    out["create_run_s"] = time.perf_counter() - t0
    eight = engine_datums(cycle_rows(pig_latin_examples(AutoTokenizer.from_pretrained(model_dir)), 8))
    t0 = time.perf_counter()
    engine.forward_backward([ForwardBackwardInput(0, eight, "cross_entropy")])
    out["first_forward_backward_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.optim_step(0, AdamConfig(learning_rate=1e-4))
    out["first_optim_step_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.snapshot(0, "s")
    engine.sample(
        [SampleInput(prompt=np.asarray([1, 2, 3, 4], np.int32), max_tokens=16, stop_token_ids=[], snapshot="s")]
    )
    out["first_sample_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.sample(
        [SampleInput(prompt=np.asarray([5, 6, 7, 8], np.int32), max_tokens=16, stop_token_ids=[], snapshot="s")]
    )
    out["second_sample_s"] = time.perf_counter() - t0
    # The engine's steady state: the whole warm-up plan built (what the stack's background warm-up builds), timed
    # from the load like the stack's; its slowest sample is the first (nothing runs beside it here).
    engine.warm_up(WarmUpPlan().pieces())
    out["steady_s"] = time.perf_counter() - start
    out["slowest_sample_until_steady_s"] = out["first_sample_s"]
    print(json.dumps(out), flush=True)


def engine_start(model_dir: str, cache_dir: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.cold_start", "--engine-child", model_dir, str(cache_dir)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep", help="work in this directory (kept) instead of a temporary one")
    parser.add_argument(
        "--logs",
        help="copy the stack's logs (up.log, logs/*.log: both starts, with timestamps) "
        "into this directory, for the profile",
    )
    parser.add_argument("--engine-child", nargs=2, metavar=("MODEL_DIR", "CACHE_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_child:
        engine_child(*args.engine_child)
        return
    # The stack's compilation cache must start empty and live in its state dir, not in a shared test cache.
    os.environ.pop("TINKERFLOW_COMPILATION_CACHE_DIR", None)
    with tempfile.TemporaryDirectory(prefix="tinkerflow-bench-cold-", dir=args.keep) as work:
        state = Path(work) / "state"
        first, model_dir = stack_start(state)
        restart, _ = stack_start(state)
        if args.logs:
            _copy_logs(state, Path(args.logs))
        engine_cache = Path(work) / "engine-xla-cache"
        engine_first = engine_start(model_dir, engine_cache)
        engine_restart = engine_start(model_dir, engine_cache)
    for start, sdk, engine in (("first", first, engine_first), ("restart", restart, engine_restart)):
        for name in FIGURES:
            emit_pair(
                f"cold_start_{name}",
                "s",
                sdk[name],
                engine[name],
                start=start,
                **{k: v for k, v in sdk.items() if k not in FIGURES},
            )


if __name__ == "__main__":
    main()
