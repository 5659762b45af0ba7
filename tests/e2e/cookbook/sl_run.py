"""`python -m tests.e2e.cookbook.sl_run LOG_PATH DATA BASE_MODEL BASE_URL MAX_STEPS`: the cookbook's
supervised.train.main with the config test_supervised.py uses, in its own process (so a test can kill it)."""

from __future__ import annotations

import asyncio
import sys


def build_config(log_path: str, data: str, base_model: str, base_url: str, max_steps: int):
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=base_model, renderer_name="role_colon", max_length=64, batch_size=8
    )
    return train.Config(
        log_path=log_path,
        model_name=base_model,
        recipe_name="tinkerflow-e2e",
        renderer_name="role_colon",
        dataset_builder=FromConversationFileBuilder(file_path=data, test_size=8, common_config=common),
        learning_rate=3e-3,
        lr_schedule="constant",
        lora_rank=8,
        base_url=base_url,
        num_epochs=2,
        save_every=3,
        eval_every=3,
        rolling_save_every=1,
        max_steps=max_steps,
    )


if __name__ == "__main__":
    from tinker_cookbook.supervised import train

    log_path, data, base_model, base_url, max_steps = sys.argv[1:6]
    asyncio.run(train.main(build_config(log_path, data, base_model, base_url, int(max_steps))))
