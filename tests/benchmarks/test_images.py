"""`python -m benchmarks.images --smoke`: the images benchmark runs on CPU on one small size, engine alone, and
reports its three figures with positive values, so a full run (and a GPU's) does not fail at its first line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# Forty seconds of compiles on two cores: under -m slow (the images' numerics are tests/engine/test_*vision*.py).
@pytest.mark.slow
def test_the_images_benchmark_smoke_reports_its_figures():
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.images", "--smoke"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = {x["figure"]: x for x in map(json.loads, run.stdout.splitlines()) if x.get("figure")}
    assert set(lines) == {"images_tower_images_per_s", "images_forward_backward_ms", "images_sample_ms"}, lines
    tower = lines["images_tower_images_per_s"]
    assert tower["engine"] > 0 and tower["tokens"] > 0 and tower["compile_s"] > 0, tower
    for figure in ("images_forward_backward_ms", "images_sample_ms"):
        got = lines[figure]
        assert got["engine"] > 0 and got["text_engine_ms"] > 0 and got["image_over_text_engine"] > 0, got
