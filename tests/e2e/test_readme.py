"""The README's SDK loop runs as written against the stack, with the real SDK: the loss falls, the sample is the
translation it was taught, and no SDK deprecation warning is printed (a newcomer copies exactly this)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.platform.test_front_door import readme_loop

pytestmark = pytest.mark.e2e


def test_the_readme_loop_runs_as_written(stack, tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(readme_loop())
    env = dict(os.environ, TINKER_BASE_URL=stack.base_url, TINKER_API_KEY=stack.api_key, TINKER_TELEMETRY="0")
    env["PYTHONFAULTHANDLER"] = "1"  # a client killed by a signal shows its threads' stacks (tests/e2e/conftest.py)
    # Every deprecation shown, whoever warns: the SDK marks its deprecated calls with FutureWarning.
    warnings = ["-W", "always::FutureWarning", "-W", "always::DeprecationWarning"]
    run = subprocess.run(
        [sys.executable, *warnings, str(script)], env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.strip().splitlines()
    losses = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("step ")]
    assert len(losses) == 10 and losses[-1] < losses[0] / 10, run.stdout
    assert lines[-1].strip() == "ello-hay orld-way", run.stdout
    assert "FutureWarning" not in run.stderr and "DeprecationWarning" not in run.stderr, run.stderr
