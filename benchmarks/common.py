"""Helpers every benchmark shares: timing statistics, JSON lines, the Pig Latin batch, a stack to measure."""

from __future__ import annotations

import contextlib
import json
import platform as _stdlib_platform  # noqa: F401  (the stdlib one: the repo's platform/ is not importable)
import statistics
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
def running_stack(base_url: str | None, api_key: str):
    """Use the stack at base_url, or launch one (`tinkerflow up` on free ports) for the duration."""
    if base_url:
        yield base_url, None
        return
    from tinkerflow.cli.launch import launch

    with tempfile.TemporaryDirectory(prefix="tinkerflow-bench-") as d:
        stack = launch(Path(d) / "state", api_key=api_key)
        try:
            yield stack.base_url, stack
        finally:
            stack.stop()
