"""tinker-cookbook 0.6.1's recipe CLIs, unmodified, with its `qwen3_5` renderer against the tiny Qwen3.5 served as
`Qwen/Qwen3.5-4B` (tests/e2e/conftest.py `qwen3_5_stack`): chat_sl, math_rl (sync and one step off-policy async)
and preference.shorter, run as test_recipe_clis.py and test_recipes_games.py run them against the tiny Qwen3 (the
same local conversation file, the arithmetic env, the same sizes). preference.shorter runs under its own default
model name, `Qwen/Qwen3.5-4B`; the others name it.

The client loads the hub id's tokenizer as a user's offline machine does, from its Hugging Face cache: a cache
holding the tiny model's tokenizer and config under that id (the stack's own cache stays empty). chat_sl is in the
default run; the others are `slow` (`bash scripts/test.sh -m slow tests/e2e/cookbook`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import QWEN3_5_HUB_ID
from tests.e2e.cookbook.conftest import assert_steps_contiguous_from_zero, read_metrics, require_cookbook
from tests.e2e.cookbook.hf_offline import hub_cache
from tests.e2e.cookbook.test_recipe_clis import run_recipe
from tests.e2e.cookbook.test_recipes_games import rewards
from tests.e2e.cookbook.test_supervised import write_conversations

require_cookbook()

RENDERER = "renderer_name=qwen3_5"


@pytest.fixture(scope="module")
def client_hub_cache(tmp_path_factory, qwen3_5_model) -> Path:
    return hub_cache(qwen3_5_model, tmp_path_factory.mktemp("client-hub"), QWEN3_5_HUB_ID)


@pytest.fixture
def qwen3_5_env(qwen3_5_stack, client_hub_cache, monkeypatch):
    """cookbook_env's settings (tests/e2e/cookbook/conftest.py) for the Qwen3.5 stack, with the client's cache."""
    monkeypatch.setenv("TINKER_API_KEY", qwen3_5_stack.api_key)
    monkeypatch.setenv("TINKER_BASE_URL", qwen3_5_stack.base_url)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(client_hub_cache))
    return qwen3_5_stack


def common(log_path: Path) -> list[str]:
    return [RENDERER, f"log_path={log_path}", "behavior_if_log_dir_exists=delete"]


@pytest.mark.timeout(1500)
def test_chat_sl_with_the_qwen3_5_renderer(qwen3_5_env, tmp_path):
    data = tmp_path / "conversations.jsonl"
    write_conversations(data)
    log_path = tmp_path / "chat_sl"
    run_recipe(
        "tinker_cookbook.recipes.chat_sl.train",
        [
            *common(log_path),
            f"base_url={qwen3_5_env.base_url}",
            f"model_name={QWEN3_5_HUB_ID}",
            f"dataset={data}",
            "batch_size=8",
            "max_length=64",
            "max_steps=3",
            "eval_every=0",
            "save_every=0",
        ],
        1400,
    )
    assert assert_steps_contiguous_from_zero(read_metrics(log_path)) == [0, 1, 2]


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("off_policy", [None, 1], ids=["sync", "async"])
def test_math_rl_with_the_qwen3_5_renderer(qwen3_5_env, tmp_path, off_policy):
    log_path = tmp_path / "math_rl"
    run_recipe(
        "tinker_cookbook.recipes.math_rl.train",
        [
            *common(log_path),
            f"base_url={qwen3_5_env.base_url}",
            f"model_name={QWEN3_5_HUB_ID}",
            "env=arithmetic",
            "groups_per_batch=4",
            "max_steps=2",
            "eval_every=0",
            "save_every=0",
            *([f"max_steps_off_policy={off_policy}"] if off_policy is not None else []),
        ],
        1400,
    )
    rows = read_metrics(log_path)
    # rl.train adds one last row at step max_steps for its final checkpoint.
    assert assert_steps_contiguous_from_zero(rows) in ([0, 1], [0, 1, 2])
    rewarded = sorted(r["step"] for r in rows if any(k.endswith("reward/total") for k in r))
    assert rewarded == [0, 1], rewarded


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_preference_shorter_under_its_default_model_name(qwen3_5_env, tmp_path):
    log_path = tmp_path / "shorter"
    run_recipe(
        "tinker_cookbook.recipes.preference.shorter.train",
        [
            *common(log_path),  # preference.shorter has no base_url setting: TINKER_BASE_URL
            "batch_size=2",
            "group_size=2",
            "max_tokens=12",
            "eval_every=0",
            "max_steps=2",
        ],
        1400,
    )
    rows = read_metrics(log_path)
    assert assert_steps_contiguous_from_zero(rows) in ([0, 1], [0, 1, 2])
    assert sorted(rewards(rows)) == [0, 1]
