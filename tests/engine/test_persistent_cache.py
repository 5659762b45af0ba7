"""A restarted JAX worker with a warm persistent compilation cache compiles nothing, warm-up included,
and gives the same numbers: counted with JAX's own cache events, in two fresh processes sharing one cache directory,
each started as the jax-worker command starts its engine (no torch, warm-up before work)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCENARIO = Path(__file__).with_name("persistent_cache_scenario.py")


def _lifetime(model: Path, cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as the worker has
    out = subprocess.run(
        [sys.executable, str(SCENARIO), str(model), str(cache)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_compiles_nothing_and_answers_the_same(tmp_path):
    from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "model")
    cold = _lifetime(model, tmp_path / "xla-cache")
    warm = _lifetime(model, tmp_path / "xla-cache")
    assert cold["misses"] > 0, cold  # the first lifetime compiled (and wrote) its programs
    assert warm["misses"] == 0, warm  # the restarted one read every program back
    assert warm["hits"] >= cold["misses"], (cold, warm)
    assert warm["loss"] == cold["loss"] and warm["tokens"] == cold["tokens"], (cold, warm)
    # The warm-up built every program the steps needed: none after it, in either lifetime.
    assert cold["warm_up_programs"] > 0 and cold["after_warm_up"] == 0 and warm["after_warm_up"] == 0, (cold, warm)
    assert not cold["torch"] and not warm["torch"], (cold, warm)
