"""What `bash scripts/demo.sh` costs on this machine, part by part; one JSON line per figure.

    python -m benchmarks.demo                       # launches `tinkerflow up` on free ports, as the demo does
    python -m benchmarks.demo --base-url URL        # an existing stack (its compile caches may be warm)

Figures: the stack's start (until it serves its model) and scripts/demo_learn.py (optimizer steps until greedy
sampling returns the translation, and its wall time), in the demo's order.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import emit, running_stack

REPO = Path(__file__).resolve().parents[1]


def run(script: Path, base_url: str, api_key: str) -> tuple[float, str]:
    env = dict(
        os.environ,
        TINKER_BASE_URL=base_url,
        TINKER_API_KEY=api_key,
        TINKER_TELEMETRY="0",
        TRANSFORMERS_NO_ADVISORY_WARNINGS="1",
    )
    t0 = time.perf_counter()
    # Exit 1 means "not learned within the step cap", a figure like any other (`learned` says which).
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True).stdout
    return time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", help="an existing stack (default: launch one)")
    parser.add_argument("--api-key", default="tml-bench")
    args = parser.parse_args()

    t0 = time.perf_counter()
    with running_stack(args.base_url, args.api_key) as (base_url, stack):
        if stack is not None:
            emit(figure="demo_stack_start_s", value=round(time.perf_counter() - t0, 1))
        seconds, out = run(REPO / "scripts" / "demo_learn.py", base_url, args.api_key)
        steps = sum(line.startswith("step ") for line in out.splitlines())
        learned = any(line.startswith("Learned:") for line in out.splitlines())
        emit(figure="demo_learn_steps", value=steps, learned=learned)
        emit(figure="demo_learn_s", value=round(seconds, 1), learned=learned)
    emit(figure="demo_total_s", value=round(time.perf_counter() - t0, 1))


if __name__ == "__main__":
    main()
