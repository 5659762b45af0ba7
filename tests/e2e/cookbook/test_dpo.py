"""tinker_cookbook.preference.train_dpo.main, unmodified, on local comparison pairs (ComparisonBuilderFromJsonl):
its forward_backward_custom DPO loss runs against the service, metrics.jsonl steps are contiguous from 0 and the
preference margin grows."""

from __future__ import annotations

import json

import pytest

from tests.e2e.cookbook.conftest import assert_steps_contiguous_from_zero, read_metrics, require_cookbook

require_cookbook()

WORDS = ["red", "green", "blue", "black", "white", "pink", "gold", "grey"]


@pytest.mark.timeout(1500)
def test_train_dpo_main_on_local_pairs(cookbook_env, base_model, tmp_path):
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
    from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    pairs = tmp_path / "pairs.jsonl"
    with pairs.open("w") as f:
        for i in range(16):  # prefer repeating the word over a different one
            w, other = WORDS[i % 8], WORDS[(i + 3) % 8]
            f.write(
                json.dumps(
                    {
                        "label": "A",
                        "comparison": {
                            "prompt_conversation": [{"role": "user", "content": f"repeat {w}"}],
                            "completion_A": [{"role": "assistant", "content": w}],
                            "completion_B": [{"role": "assistant", "content": other}],
                        },
                    }
                )
                + "\n"
            )
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=base_model, renderer_name="role_colon", max_length=64, batch_size=4
    )
    log_path = tmp_path / "dpo"
    config = train_dpo.Config(
        log_path=str(log_path),
        model_name=base_model,
        recipe_name="tinkerflow-e2e",
        renderer_name="role_colon",
        dataset_builder=DPODatasetBuilderFromComparisons(
            comparison_builder=ComparisonBuilderFromJsonl(train_path=str(pairs)), common_config=common
        ),
        learning_rate=1e-2,
        lr_schedule="constant",
        dpo_beta=0.1,
        lora_rank=8,
        base_url=cookbook_env.base_url,
        save_every=0,
        eval_every=0,
        max_steps=4,
    )
    train_dpo.main(config)
    rows = read_metrics(log_path)
    steps = assert_steps_contiguous_from_zero(rows)
    assert steps[-1] == 3
    margin = {r["step"]: r["margin"] for r in rows if "margin" in r}
    assert margin[3] > margin[0], margin
