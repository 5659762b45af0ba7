"""tinker_cookbook.supervised.train.main, unmodified: a conversation JSONL builder with a held-out split (the
loop's own NLL evaluator), periodic and rolling checkpoints; the driving process is killed mid-run and the run
resumed from log_path continues the step count."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.cookbook.conftest import (
    assert_steps_contiguous_from_zero,
    read_checkpoints,
    read_metrics,
    require_cookbook,
)

require_cookbook()

COLOURS = ["red", "green", "blue", "black", "white", "pink", "gold", "grey"]
STEPS = 10  # 40 training conversations / batch 8 = 5 batches, 2 epochs
REPO = Path(__file__).resolve().parents[3]


def write_conversations(path, n: int = 48) -> None:
    """A pattern a tiny model learns in a few steps: the assistant repeats two words back."""
    with path.open("w") as f:
        for i in range(n):
            a, b = COLOURS[i % 8], COLOURS[(i * 3 + 1) % 8]
            f.write(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"say {a} {b}"},
                            {"role": "assistant", "content": f"{a} {b}"},
                        ]
                    }
                )
                + "\n"
            )


def run_until_killed(args: list[str], log_path: Path, *, after_batch: int, timeout_s: float) -> None:
    """Start the loop in its own process and kill -9 it once a checkpoint past `after_batch` is recorded."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.cookbook.sl_run", *args],
        cwd=REPO,
        env=os.environ,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if any(c.get("batch", 0) >= after_batch and c.get("name") != "final" for c in read_checkpoints(log_path)):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"the loop {'exited' if proc.poll() is not None else 'timed out'} before batch {after_batch}")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@pytest.mark.timeout(2400)
def test_supervised_train_main_loss_falls_checkpoints_and_resume_after_a_crash(cookbook_env, base_model, tmp_path):
    import tinker
    from tinker_cookbook.supervised import train

    from tests.e2e.cookbook.sl_run import build_config

    data = tmp_path / "conversations.jsonl"
    write_conversations(data)
    log_path = tmp_path / "sl"
    args = [str(log_path), str(data), base_model, cookbook_env.base_url, str(STEPS)]
    run_until_killed(args, log_path, after_batch=3, timeout_s=1500)
    before = read_metrics(log_path)
    assert_steps_contiguous_from_zero(before)

    # Resume from log_path: the loop finds checkpoints.jsonl and continues from its last training state.
    asyncio.run(train.main(build_config(*args[:4], STEPS)))  # pyright: ignore[reportCallIssue] (args holds the first four)
    rows = read_metrics(log_path)
    steps = assert_steps_contiguous_from_zero(rows)
    assert steps == list(range(STEPS)), steps
    nll = {r["step"]: r["train_mean_nll"] for r in rows if "train_mean_nll" in r}
    assert nll[STEPS - 1] < nll[0] * 0.7, nll
    assert any(k.startswith("test/") for r in rows for k in r), "the held-out NLL evaluator never reported"
    # optim_step metrics arrive namespaced; the loop's own learning_rate column is its own.
    assert all(r["learning_rate"] == 3e-3 for r in rows if "learning_rate" in r)

    # The loop's periodic checkpoints are listed through the SDK's RestClient (rolling ones it deletes itself).
    rest = tinker.ServiceClient(base_url=cookbook_env.base_url, api_key=cookbook_env.api_key).create_rest_client()
    records = read_checkpoints(log_path)
    assert records[-1]["name"] == "final"
    kept = {c["state_path"] for c in records if "state_path" in c and not c.get("rolling")}
    listed = set()
    for run_id in {p.split("/")[2] for p in kept}:
        listed |= {c.tinker_path for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert kept <= listed, (kept, listed)
