"""`python -m benchmarks.recipe_soak` end to end at its smallest: it launches a stack (warm-up off, so the soak starts
at once), runs one chat_sl recipe CLI for one step, samples the JAX worker, and prints every figure and writes the
time series. About 15-30 s on the 2-core box."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = {
    "recipe_soak_steps_per_min",
    "recipe_soak_worker_restarts",
    "recipe_soak_programs_compiled_after_warm_up",
    "recipe_soak_compile_s_after_warm_up",
    "recipe_soak_memory_mappings",
    "recipe_soak_worker_rss_mb",
    "recipe_soak_stack_log_errors",
}


@pytest.mark.timeout(600)
def test_recipe_soak_runs_one_recipe_and_reports_every_figure(tmp_path: Path) -> None:
    pytest.importorskip("tinker_cookbook", reason="the cookbook extra is not installed (scripts/setup.sh …,cookbook)")
    out = tmp_path / "soak.json"
    args = ["--minutes", "0", "--max-runs", "1", "--recipes", "chat_sl", "--steps", "1", "--sample-s", "2"]
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.recipe_soak", *args, "--stack-arg=--warm-up=off", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert {x["figure"] for x in lines} == FIGURES
    by = {(x["figure"], x.get("recipe")): x for x in lines}
    chat = by["recipe_soak_steps_per_min", "chat_sl"]
    assert (chat["steps"], chat["recipe_runs"], chat["failed"]) == (1, 1, 0), chat
    assert chat["tinkerflow"] > 0
    assert by["recipe_soak_worker_restarts", None]["tinkerflow"] == 0
    # Warm-up off: the recipe's own programs are compiled on its traffic, and the log and /metrics agree on them.
    compiled = by["recipe_soak_programs_compiled_after_warm_up", None]
    assert compiled["tinkerflow"] >= 1 and compiled["tinkerflow"] == compiled["metrics_compiles"], compiled
    assert by["recipe_soak_memory_mappings", None]["max"] > 0
    assert by["recipe_soak_worker_rss_mb", None]["max"] > 0
    assert all(x["engine"] is None for x in lines)  # no engine-alone baseline for a soak
    record = json.loads(out.read_text())
    assert len(record["series"]) >= 2 and record["series"][-1]["steps"] == 1
    assert record["runs"][0]["status"] == 0
    assert (out.with_suffix("") / "stack-logs" / "jax-worker.log").exists()
