"""The demo's training script (scripts/demo_learn.py, what scripts/demo.sh runs under `tinkerflow up`): against the
real stack it trains the embedded model until greedy sampling returns the translation, draws the curve and names
the run, never a URL (the stack that served it may be stopping)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def test_demo_learns_pig_latin_and_names_its_run(stack):
    env = dict(os.environ, TINKER_API_KEY=stack.api_key, TINKER_BASE_URL=stack.base_url, TINKER_TELEMETRY="0")
    env.pop("TINKERFLOW_BASE_MODEL", None)
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "demo_learn.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    lines = out.strip().splitlines()
    # it got there before the step cap, and the sampled text is the translation (the script compares them exactly)
    assert lines[-1].startswith("Learned: 'coding wizard' → 'oding-cay izard-way'"), out
    assert ":train:" in lines[-1] and "http" not in out
    steps = [line for line in lines if line.startswith("step ")]
    losses = [float(line.split()[3]) for line in steps]
    assert 1 < len(losses) < 60 and losses[-1] < losses[0] / 10, losses
    assert "Loss by step" in out and "●" in out
