"""tinker-cookbook 0.6.1's other text recipes, unmodified, through their CLIs against the stack, offline: only the
hub-only settings are overridden (the served tiny model and `renderer_name=role_colon`; sizes a 2-core machine
finishes), and a hub data set is a small synthetic copy in the local datasets cache (hf_offline.py)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.cookbook.conftest import assert_steps_contiguous_from_zero, read_metrics, require_cookbook
from tests.e2e.cookbook.hf_offline import cache_dataset
from tests.e2e.cookbook.test_recipe_clis import run_recipe

require_cookbook()


@pytest.mark.timeout(1500)
def test_prompt_distillation_train(cookbook_env, base_model, tmp_path):
    """prompt_distillation.train on a file in the format its create_data step writes (a user message, the teacher's
    one-word label as the assistant's); create_data itself samples a hard-coded hub teacher (docs/cookbook.md)."""
    data = tmp_path / "prompt_distillation_data.jsonl"
    sentences = ["the quick brown fox", "le renard brun", "el zorro marron", "der braune fuchs"] * 4
    labels = ["en", "fr", "es", "ot"] * 4
    data.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": s}, {"role": "assistant", "content": label}]}) + "\n"
            for s, label in zip(sentences, labels, strict=True)
        )
    )
    log_path = tmp_path / "prompt_distillation"
    run_recipe(
        "tinker_cookbook.recipes.prompt_distillation.train",
        [
            f"model_name={base_model}",
            "renderer_name=role_colon",
            f"file_path={data}",
            "batch_size=4",
            "num_epochs=1",
            "max_length=64",
            "eval_every=0",
            "save_every=0",
            "max_steps=3",
            f"log_path={log_path}",
            "behavior_if_log_dir_exists=delete",
        ],
        1400,
    )
    rows = read_metrics(log_path)
    assert assert_steps_contiguous_from_zero(rows) == [0, 1, 2]
    losses = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(losses) == 3 and losses[-1] < losses[0], losses


@pytest.mark.timeout(1500)
def test_true_thinking_score_analyze(cookbook_env, base_model, tmp_path, monkeypatch):
    """true_thinking_score.analyze on gsm8k (a synthetic copy): it samples a chain of thought, cuts it into steps and
    scores each from prompt logprobs under perturbations, many sampling calls per problem."""
    cache = tmp_path / "hf-datasets"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    questions = [
        "Tom has 3 apples and buys 4 more. How many apples does he have?",
        "A box holds 6 eggs. How many eggs are in 2 boxes?",
    ]
    cache_dataset(
        cache,
        "openai/gsm8k",
        "main",
        {"test": {"question": questions, "answer": ["3 + 4 = 7\n#### 7", "6 * 2 = 12\n#### 12"]}},
    )
    log_path = tmp_path / "tts"
    run_recipe(
        "tinker_cookbook.recipes.true_thinking_score.analyze",
        [
            f"model_name={base_model}",
            "renderer_name=role_colon",
            "dataset=gsm8k",
            "n_problems=2",
            "max_tokens=48",
            "concurrency=2",
            f"log_path={log_path}",
        ],
        1400,
    )
    per_problem = [json.loads(line) for line in (log_path / "tts_per_problem.jsonl").read_text().splitlines()]
    assert len(per_problem) == 2
    assert (log_path / "tts_summary.json").exists()
