"""The recipe CLIs as a user runs them (`python -m tinker_cookbook.recipes.… key=value …`), against the stack.

Only the settings that cannot hold offline are overridden: `model_name` (the defaults are hub ids; here the served
tiny model, with `renderer_name=role_colon` since no per-model table knows it), chat_sl's `dataset` (a local
conversation file instead of a hub data set), and the sizes (`batch_size`/`groups_per_batch`, `max_steps`) so a
2-core CI machine finishes. math_rl keeps its default loss, `stable_reinforce`.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.cookbook.conftest import assert_steps_contiguous_from_zero, read_metrics, require_cookbook
from tests.e2e.cookbook.test_supervised import write_conversations

require_cookbook()


def run_recipe(module: str, args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, "-m", module, *args], env=os.environ, capture_output=True, text=True, timeout=timeout_s
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run


@pytest.mark.timeout(1500)
def test_chat_sl_train_cli(cookbook_env, base_model, tmp_path):
    data = tmp_path / "conversations.jsonl"
    write_conversations(data)
    log_path = tmp_path / "chat_sl"
    run_recipe(
        "tinker_cookbook.recipes.chat_sl.train",
        [
            f"base_url={cookbook_env.base_url}",
            f"model_name={base_model}",
            "renderer_name=role_colon",
            f"dataset={data}",
            "batch_size=8",
            "max_length=64",
            "max_steps=3",
            "eval_every=0",
            "save_every=0",
            f"log_path={log_path}",
            "behavior_if_log_dir_exists=delete",
        ],
        1400,
    )
    assert assert_steps_contiguous_from_zero(read_metrics(log_path)) == [0, 1, 2]


@pytest.mark.slow  # ~2 minutes here: the chat_sl CLI keeps a recipe CLI in the default run
@pytest.mark.timeout(1500)
def test_math_rl_train_cli_arithmetic(cookbook_env, base_model, tmp_path):
    log_path = tmp_path / "math_rl"
    run_recipe(
        "tinker_cookbook.recipes.math_rl.train",
        [
            f"base_url={cookbook_env.base_url}",
            f"model_name={base_model}",
            "renderer_name=role_colon",
            "env=arithmetic",
            "groups_per_batch=4",
            "max_steps=2",
            "eval_every=0",
            "save_every=0",
            f"log_path={log_path}",
            "behavior_if_log_dir_exists=delete",
        ],
        1400,
    )
    rows = read_metrics(log_path)
    # rl.train adds one last row at step max_steps for its final checkpoint.
    assert assert_steps_contiguous_from_zero(rows) in ([0, 1], [0, 1, 2])
    rewarded = sorted(r["step"] for r in rows if any(k.endswith("reward/total") for k in r))
    assert rewarded == [0, 1], rewarded
