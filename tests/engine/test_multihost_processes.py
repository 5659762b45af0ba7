"""Multi-host JAX worker across 2 real CPU processes joined by jax.distributed (gloo collectives) that together train
and sample on an fsdp=2 mesh spanning both, matching this process's 1-device engine (the in-process protocol and the
CLI flags are test_multihost.py).

Process 0 runs as tests/engine/multihost_scenario.py (which drives the engine as the worker's process 0 does, without
Temporal) and process 1 as the real `tinkerflow jax-worker --process-id 1` follower.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

SCENARIO = Path(__file__).with_name("multihost_scenario.py")
# float32 on CPU; with fsdp=2 across processes the batch rows and the hidden axis are split, so matmul and gradient
# sums are reduced (over gloo) in another order than on one device: each value may differ in its last few bits,
# amplified a little by two AdamW steps and the log-softmax. 1e-5 of each array's scale is ~100x that noise and far
# below any real bug (a wrong shard or a stale step moves values by >= 1e-2). Token ids must match exactly.
REL = 1e-5
# Except the trained weights: Adam divides each gradient element by its own running magnitude, so a weight moves by
# ~lr per step whatever its gradient's size, and an element whose gradient is tiny (a rare token's unembedding
# column, a sum that nearly cancels) carries the reordering noise of that gradient relative to itself, not to the
# array. Bound them by a thousandth of one optimizer step instead (seen: ~6e-5 of a step); a lost or doubled
# step, or a wrong shard, is off by a whole step.
WEIGHT_ATOL_STEPS = 1e-3
PROCESS_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scenario_module():
    spec = importlib.util.spec_from_file_location("multihost_scenario", SCENARIO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _start_two_processes(model_dir: Path, tmp_path: Path) -> tuple[list[subprocess.Popen], Path]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKERFLOW_") and k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")  # one CPU device per process
    coordinator = f"127.0.0.1:{_free_port()}"
    out = tmp_path / "leader.json"
    leader = [sys.executable, str(SCENARIO), str(model_dir), coordinator, str(out), "--mesh-fsdp", "2"]
    flags = {
        "--base-model": str(model_dir),
        "--max-lora-adapters": "4",
        "--max-lora-rank": "8",
        "--state-dir": str(tmp_path / "state"),
        "--coordinator-address": coordinator,
        "--num-processes": "2",
        "--process-id": "1",
        "--mesh-fsdp": "2",
        "--temporal-address": "127.0.0.1:1",  # never dialled
    }
    follower = [sys.executable, "-m", "tinkerflow.cli.main", "jax-worker", *(x for kv in flags.items() for x in kv)]
    procs = []
    for n, cmd in enumerate((leader, follower)):
        with open(tmp_path / f"process{n}.log", "w") as log:  # the child keeps its own copy of the descriptor
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs, out


def _wait(procs: list[subprocess.Popen], tmp_path: Path) -> None:
    """Until both exit, one fails (then the other, which would wait for it, is killed) or the time is up."""
    deadline = time.monotonic() + PROCESS_TIMEOUT_S
    try:
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    logs = "\n".join(
        f"--- process {n} (rc {p.returncode}) ---\n" + (tmp_path / f"process{n}.log").read_text()[-4000:]
        for n, p in enumerate(procs)
    )
    assert all(p.returncode == 0 for p in procs), logs


def _max_rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30)) if want.size else 0.0


@pytest.mark.timeout(PROCESS_TIMEOUT_S + 120)
def test_two_cpu_processes_train_and_sample_like_one(qwen3_dir, tmp_path, request):
    """Process 0 drives, process 1 (the real jax-worker CLI) follows: create_adapter, 2x (forward_backward +
    optim_step) over two adapters, the trained weights fetched across hosts, a rejected call, greedy and seeded
    sampling of a snapshot; the same as this process's 1-device engine. An adapter created without a seed comes out
    the same on both processes (the leader draws the seed)."""
    scenario = _scenario_module()
    t0 = time.perf_counter()
    procs, out = _start_two_processes(qwen3_dir, tmp_path)
    try:  # meanwhile, the 1-process reference on the session's engine (loaded now if no test did yet)
        engine = request.getfixturevalue("engine")
        assert (engine.max_lora_adapters, engine.max_lora_rank) == (scenario.MAX_ADAPTERS, scenario.MAX_RANK)
        want = json.loads(json.dumps(scenario.run(engine)))
    finally:
        _wait(procs, tmp_path)
    got = json.loads(out.read_text())
    elapsed = time.perf_counter() - t0

    assert got["process_count"] == 2 and got["mesh"] == {"fsdp": 2, "tp": 1}
    assert got["seedless_adapter_agrees"] is True
    assert got["rejected"] == want["rejected"] and "max_lora_rank" in got["rejected"]
    for name in ("greedy_tokens", "seeded_tokens"):
        assert got[name] == want[name], name
    diffs = {}
    for name in ("loss", "logprobs", "grad_norm", "greedy_logprobs", "prompt_logprobs", "seeded_logprobs"):
        diffs[name] = _max_rel(got[name], want[name])
    assert sorted(got["weights0"]) == sorted(want["weights0"])
    weights_diff = (
        max(float(np.max(np.abs(np.subtract(got["weights0"][k], want["weights0"][k])))) for k in want["weights0"])
        / scenario.LEARNING_RATE
    )
    print(
        f"\n2-process vs 1-process: max difference relative to each array's scale {json.dumps(diffs)}, "
        f"trained weights {weights_diff:.2e} of an optimizer step; leader timing {got['timing']}; "
        f"test {elapsed:.1f}s"
    )
    for name, diff in diffs.items():
        assert diff <= REL, f"{name}: {diff:.2e} of its scale > {REL}"
    assert weights_diff <= WEIGHT_ATOL_STEPS, f"trained weights differ by {weights_diff:.2e} of an optimizer step"
