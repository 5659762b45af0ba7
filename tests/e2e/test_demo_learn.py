"""The demo's second half (scripts/demo_learn.py, run by scripts/demo.sh after the seed's Pig Latin loop): against the
real stack it trains the embedded model until greedy sampling returns the translation, draws the curve and names
the console URL."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e


def test_demo_learns_pig_latin_and_points_at_the_console(stack):
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
    assert lines[-1] == "OK"
    # it got there before the step cap, and the sampled text is the translation (the script compares them exactly)
    assert any(line.startswith("Learned: 'coding wizard' → 'oding-cay izard-way'") for line in lines), out
    steps = [line for line in lines if line.startswith("step ")]
    losses = [float(line.split()[3]) for line in steps]
    assert 1 < len(losses) < 60 and losses[-1] < losses[0] / 10, losses
    assert f"in the console: {stack.base_url}/console" in out
    assert "Loss by step" in out and "●" in out
