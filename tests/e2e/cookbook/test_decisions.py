"""The decisions recipes, unmodified, against the stack: `tinker_cookbook.recipes.decisions.forecasting` scores
every yes/no decision with `target_prompt_logprobs` (sparse CSR, one row named) and trains on a Brier loss through
forward_backward_custom. Its data is Prophet Arena's CSV: here a small local file in the same columns (the hub copy
cannot be fetched offline), with events on both sides of the recipe's split date."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.e2e.cookbook.conftest import read_metrics, require_cookbook
from tests.e2e.cookbook.test_recipe_clis import run_recipe

require_cookbook()

COLUMNS = [
    "submission_id",
    "event_ticker",
    "title",
    "snapshot_time",
    "close_time",
    "market_outcome",
    "category",
    "markets",
    "sources",
]


def write_prophet_arena(path: Path, events: int = 12) -> None:
    """`events` events, each with two binary markets: the first half closed before 2025-10-20, the rest open after."""
    with path.open("w", newline="", encoding="utf-8") as f:
        out = csv.DictWriter(f, fieldnames=COLUMNS)
        out.writeheader()
        for e in range(events):
            before = e < events // 2
            day = 1 + e
            snapshot = f"2025-{9 if before else 11:02d}-{day:02d}T00:00:00Z"
            close = f"2025-{9 if before else 11:02d}-{day + 5:02d}T00:00:00Z"
            markets = [f"the tide is high on day {e}", f"the fox jumps on day {e}"]
            out.writerow(
                {
                    "submission_id": f"s{e}",
                    "event_ticker": f"EV{e}",
                    "title": f"What happens on day {e}?",
                    "snapshot_time": snapshot,
                    "close_time": close,
                    "category": "weather",
                    "market_outcome": json.dumps({markets[0]: e % 2, markets[1]: 1 - e % 2}),
                    "markets": json.dumps(markets),
                    "sources": json.dumps(
                        [{"title": "the almanac", "summary": "the quick brown fox jumps", "ranking": 1}]
                    ),
                }
            )


@pytest.mark.timeout(1500)
def test_decisions_forecasting_recipe(cookbook_env, base_model, tmp_path):
    data = tmp_path / "prophet_arena.csv"
    write_prophet_arena(data)
    log_path = tmp_path / "forecasting"
    run_recipe(
        "tinker_cookbook.recipes.decisions.forecasting",
        [
            f"base_url={cookbook_env.base_url}",
            f"model_name={base_model}",
            "renderer_name=role_colon",
            f"data_path={data}",
            "lora_rank=4",
            "batch_size=4",
            "max_steps=2",
            "eval_every=0",
            "save_every=0",
            f"log_path={log_path}",
            "behavior_if_log_dir_exists=delete",
        ],
        1400,
    )
    rows = read_metrics(log_path)
    assert rows, "the recipe wrote no metrics"
    scored = [r for r in rows if any("brier" in k or "auc" in k for k in r)]
    assert scored, rows[-1]
