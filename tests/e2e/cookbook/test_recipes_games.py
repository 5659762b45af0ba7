"""tinker-cookbook 0.6.1's game and preference RL recipes, unmodified, as a user runs their CLIs against the stack
(only the hub-only defaults overridden: the served tiny model, `renderer_name=role_colon`, and sizes a 2-core
machine finishes). The tiny model cannot play, so rewards stay near the format penalty: what is checked is the loop,
step by step, against the service (sampling many turns, training on the trajectories). Both are `slow`."""

from __future__ import annotations

import pytest

from tests.e2e.cookbook.conftest import assert_steps_contiguous_from_zero, read_metrics, require_cookbook
from tests.e2e.cookbook.test_recipe_clis import run_recipe

require_cookbook()

SIZES = ["group_size=2", "max_tokens=12", "eval_every=0", "save_every=0", "behavior_if_log_dir_exists=delete"]


def rewards(rows: list[dict]) -> dict[int, float]:
    return {r["step"]: r["env/all/reward/total"] for r in rows if "env/all/reward/total" in r}


@pytest.mark.slow  # ~2 minutes: every turn's longer prompt is a new sampler bucket to compile
@pytest.mark.timeout(1500)
def test_guess_number(cookbook_env, base_model, tmp_path):
    """multiplayer_rl.guess_number: up to 10 turns of guesses, each answered by the env; an unparsable guess costs
    the format penalty (-1) and the game goes on."""
    log_path = tmp_path / "guess_number"
    run_recipe("tinker_cookbook.recipes.multiplayer_rl.guess_number.train", [
        f"model_name={base_model}", "renderer_name=role_colon", "batch_size=2", "max_steps=2", f"log_path={log_path}",
        *SIZES], 1400)  # fmt: skip
    rows = read_metrics(log_path)
    assert assert_steps_contiguous_from_zero(rows) in ([0, 1], [0, 1, 2])
    got = rewards(rows)
    assert sorted(got) == [0, 1] and all(-10.0 <= r <= 1.0 for r in got.values()), got


@pytest.mark.slow  # ~1 minute of multi-turn sampling
@pytest.mark.timeout(1500)
def test_preference_shorter(cookbook_env, base_model, tmp_path):
    """preference.shorter: RL from pairwise comparisons of a group's completions, judged by a preference model that
    prefers the shorter one (all in the recipe, nothing to download)."""
    log_path = tmp_path / "shorter"
    run_recipe("tinker_cookbook.recipes.preference.shorter.train", [
        f"model_name={base_model}", "renderer_name=role_colon", "batch_size=2", "group_size=2", "max_tokens=12",
        "eval_every=0", "max_steps=2", f"log_path={log_path}", "behavior_if_log_dir_exists=delete"], 1400)  # fmt: skip
    rows = read_metrics(log_path)
    assert assert_steps_contiguous_from_zero(rows) in ([0, 1], [0, 1, 2])
    assert sorted(rewards(rows)) == [0, 1]
