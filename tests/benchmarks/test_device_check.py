"""`python -m benchmarks.device_check --smoke` (CI runs it): every phase of the device check runs on tiny shapes on CPU
and reports figures, none an error, so the check is ready the day a device is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.device_check import PHASES

ROOT = Path(__file__).resolve().parents[2]


def test_every_phase_of_the_device_check_runs_on_cpu(tmp_path):
    out = tmp_path / "check.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.device_check", "--smoke", "--budget-s", "600", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    errors = [x for x in lines if "error" in x or "skipped" in x]
    assert not errors, errors
    assert {x["phase_done"] for x in lines if "phase_done" in x} == set(PHASES)
    figures = {x.get("figure") for x in lines}
    for wanted in (
        "bf16_matmul_tflops",
        "attention_vs_reference",
        "attention_fwd_bwd",
        "train_tokens_per_s",
        "long_forward_backward",
        "decode_ms_per_step",
        "sampler_vs_trainer_logprobs",
    ):
        assert wanted in figures, wanted
    for line in lines:  # where and when, on every line (measure.emit)
        assert {"device", "driver", "jax", "flax", "commit", "utc"} <= line.keys(), line
    train = next(x for x in lines if x.get("figure") == "train_tokens_per_s")
    assert {"mfu_lora", "hfu", "flops_6n_over_peak"} <= train.keys()
    assert "mfu_datasheet" not in train  # the 6·N figure is not called an MFU any more
    assert train["hardware_gflop"] > train["model_gflop"] > 0
    tenants = next(x for x in lines if x.get("figure") == "tenants")
    assert tenants["tenants_ratio"] > 0 and len(tenants["datums_per_tenant"]) == 8
    decode = [x for x in lines if x.get("figure") == "decode_ms_per_step"]
    for sample in decode:  # the decode program timed alone: a positive time per step, whatever the host's noise
        assert sample["floor_ms"] > 0 and sample["ms"] > 0 and sample["floor_ratio"] > 0 and sample["steps"] == 63
    assert {x["decode_layers"] for x in decode} == {"scan", "unrolled"}  # both loops, each shape
    assert len(decode) == 2 * len({(x["rows"], x["adapters"]) for x in decode})
    long_ = next(x for x in lines if x.get("figure") == "long_forward_backward")
    assert len(long_["step_s_all"]) == 3
    assert next(x for x in lines if x.get("figure") == "bf16_matmul_tflops")["inputs"] == "random normal"
    agree = next(x for x in lines if x.get("figure") == "sampler_vs_trainer_logprobs")
    assert agree["max_abs"] < 1e-4  # float32 on CPU: the sampler's logprobs are the trainer's
