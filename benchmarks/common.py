"""Helpers every benchmark shares: timing statistics, JSON lines, the Pig Latin batch, a stack to measure."""

from __future__ import annotations

import contextlib
import json
import os
import platform as _stdlib_platform  # noqa: F401  (the stdlib one: the repo's platform/ is not importable)
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax

PIG_LATIN = [
    {"input": "banana split", "output": "anana-bay plit-say"},
    {"input": "quantum physics", "output": "uantum-qay ysics-phay"},
    {"input": "coding wizard", "output": "oding-cay izard-way"},
]


def emit(**figure) -> None:
    figure.setdefault("device", jax.devices()[0].device_kind)
    print(json.dumps(figure), flush=True)


def time_ms(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def stats(samples: list[float]) -> dict:
    s = sorted(samples)
    return {
        "median_ms": round(statistics.median(s), 3),
        "p90_ms": round(s[min(len(s) - 1, int(0.9 * len(s)))], 3),
        "n": len(s),
    }


def pig_latin_examples(tokenizer) -> list[tuple[list[int], list[int], list[float]]]:
    """(model_input, target_tokens, weights) exactly as the acceptance script builds them."""
    rows = []
    for ex in PIG_LATIN:
        prompt = tokenizer.encode(f"English: {ex['input']}\nPig Latin:", add_special_tokens=True)
        completion = tokenizer.encode(f" {ex['output']}\n\n", add_special_tokens=False)
        tokens = prompt + completion
        weights = [0.0] * len(prompt) + [1.0] * len(completion)
        rows.append((tokens[:-1], tokens[1:], weights[1:]))
    return rows


@contextlib.contextmanager
def running_stack(base_url: str | None, api_key: str, extra: tuple[str, ...] | list[str] = ()):
    """Use the stack at base_url, or launch one (`tinkerflow up` on free ports, `extra` flags) for the duration."""
    if base_url:
        yield base_url, None
        return
    from tinkerflow.cli.launch import launch

    with tempfile.TemporaryDirectory(prefix="tinkerflow-bench-") as d:
        stack = launch(Path(d) / "state", api_key=api_key, extra=extra)
        try:
            yield stack.base_url, stack
        finally:
            stack.stop()


# --- the workloads of the table in docs/benchmarks.md (cold_start, mixed_loop, sample_sweep, tenant_sweep)


def emit_pair(figure: str, unit: str, tinkerflow: float, engine: float, **extra) -> None:
    """One figure of the table: the SDK-through-the-stack value beside the engine-alone value of the same workload,
    measured in the same run, and their ratio (tinkerflow / engine: > 1 is slower for times, < 1 is slower for
    rates). benchmarks/report.py turns these lines into docs/benchmarks.md."""
    emit(
        figure=figure,
        unit=unit,
        tinkerflow=round(tinkerflow, 3),
        engine=round(engine, 3),
        ratio=round(tinkerflow / engine, 3) if engine else None,
        **extra,
    )


def median(samples: list[float]) -> float:
    return float(statistics.median(samples))


def cycle_rows(rows: list, n: int) -> list:
    """n rows taken round-robin from `rows` (the Pig Latin batch has 3; the table's workloads use 1 and 8)."""
    return [rows[i % len(rows)] for i in range(n)]


def sdk_datums(rows) -> list:
    from tinker import types

    return [
        types.Datum(model_input=types.ModelInput.from_ints(t), loss_fn_inputs=dict(target_tokens=y, weights=w))  # pyright: ignore[reportArgumentType] (Datum converts lists)
        for t, y, w in rows
    ]


def engine_datums(rows) -> list:
    import numpy as np

    from tinkerflow.workers.engine.types import Datum

    return [
        Datum(
            tokens=np.asarray(t, np.int32),
            inputs={"target_tokens": np.asarray(y, np.int64), "weights": np.asarray(w, np.float32)},
        )
        for t, y, w in rows
    ]


def jax_worker_log(state_dir: Path) -> str:
    """What the JAX worker of a stack launched on `state_dir` has logged (every start's, appended), "" before it
    started."""
    log = state_dir / "logs" / "jax-worker.log"
    return log.read_text(errors="replace") if log.exists() else ""


def programs_built(state_dir: Path) -> int:
    """Programs the JAX worker's AOT cache has built on `state_dir` so far (its aot_cache log lines; a persistent-cache
    hit counts too: a program that start needed and did not have in memory)."""
    return jax_worker_log(state_dir).count("aot_cache: compiled ")


def worker_compiles(stack) -> int | None:
    """Programs the stack's JAX worker has compiled so far; None for a stack we did not launch (its logs are
    elsewhere)."""
    return None if stack is None else programs_built(stack.state_dir)


def wait_for_steady_state(stack, timeout_s: float = 1800.0) -> float | None:
    """Wait until the stack's JAX worker has finished its background warm-up (its log says so), so a sweep measures
    the steady state and not the first minutes after `up`, when the warm-up compiles beside the traffic (what a first
    user meets there is the cold_start benchmark's). The seconds waited; None for a stack we did not launch."""
    if stack is None:
        return None
    t0 = time.perf_counter()
    print("benchmark: waiting for the JAX worker's background warm-up to finish (steady state) …", file=sys.stderr)
    while time.perf_counter() - t0 < timeout_s:
        text = jax_worker_log(stack.state_dir)
        if "background warm-up done" in text or ", 0 after" in text:  # done, or nothing was left for the background
            return round(time.perf_counter() - t0, 1)
        time.sleep(1.0)
    raise TimeoutError(
        f"the JAX worker's background warm-up did not finish in {timeout_s:.0f} s: see its log in "
        f"{stack.state_dir / 'logs'}"
    )


def sampler_of(training):
    """save_weights_and_get_sampling_client's client (newer SDKs hand back a future of it)."""
    sampler = training.save_weights_and_get_sampling_client()
    return sampler.result() if hasattr(sampler, "result") else sampler


def served_model(base_url: str, api_key: str) -> str:
    """The base model the stack serves (its capabilities route; the SDK's own call for it is deprecated)."""
    from tinkerflow.cli.up import served_models

    models = served_models(base_url, api_key)
    if not models:
        raise RuntimeError(f"{base_url} serves no model (not up, or no JAX worker yet)")
    return models[0]


def share_compile_cache(stack) -> None:
    """Let the in-process engine read back what the stack's JAX worker compiled (its state dir's persistent cache),
    so the engine-alone part compiles less before it is timed; it changes no timed figure (those follow warm-ups)."""
    if stack is None:
        return
    from tinkerflow.workers.engine.runtime import persistent_cache

    persistent_cache.enable(Path(os.environ.get("TINKERFLOW_COMPILATION_CACHE_DIR") or stack.state_dir / "xla-cache"))
