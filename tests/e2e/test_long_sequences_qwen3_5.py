"""Qwen3.5's long context through the unmodified SDK against `tinkerflow up`: a copy of the tiny Qwen3.5 whose config
allows 65,536 positions.

A 1-token sample after a 65,535-token prompt and a 32,768-token forward_backward both answer. The prompt goes first,
on a fresh worker, so that the high-water it leaves is its own: under 4 GB, since three of the four layers are Gated
DeltaNet, whose state is constant in length, and the fourth reads its KV blocks through the engine's blockwise
attention. The forward_backward after it stays under 6 GB, the tiny Qwen3's bound at 32K
(tests/e2e/test_long_sequences.py): the memory plan trains without checkpointing when the host has room for it.

Marked slow (several minutes on two CPU cores, most of it the 32K backward and its compile):
`bash scripts/test.sh -m slow tests/e2e/test_long_sequences_qwen3_5.py`. The time and memory against length, beside
the tiny Qwen3 of the same width, are `python -m benchmarks.long_sequences_qwen3_5`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import API_KEY
from tinkerflow.cli.launch import launch
from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

POSITIONS = 65536
TRAIN_TOKENS = 32768
SAMPLE_HIGH_WATER_BYTES = 4 * 2**30  # after the 65,536-token prompt
TRAIN_HIGH_WATER_BYTES = 6 * 2**30  # after the 32,768-token forward_backward as well
TIMEOUT_S = 1800  # a 32K forward_backward of the tiny Qwen3.5, its compile included, on two loaded CPU cores


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    directory = make_tiny_model(tmp_path_factory.mktemp("qwen3_5-64k") / "model", family="qwen3_5", progress=False)
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = POSITIONS
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 2000, n).tolist()


def _high_water_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/<pid>/status")


def test_qwen3_5_trains_32k_and_answers_a_64k_prompt_through_the_sdk(tmp_path_factory, long_model):
    extra = ["--base-model", str(long_model), "--max-lora-adapters", "2", "--warm-up", "off"]
    stack = launch(tmp_path_factory.mktemp("long-qwen3_5") / "state", api_key=API_KEY, extra=extra)
    try:
        service = tinker.ServiceClient(base_url=stack.base_url, api_key=API_KEY)
        training = service.create_lora_training_client(base_model=stack.served_model(), rank=8).result()
        sampler = training.save_weights_and_get_sampling_client().result()
        pid = stack.parts()["jax-worker"]["pid"]

        prompt = types.ModelInput.from_ints(_tokens(POSITIONS - 1, 2))
        sample = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1, seed=1)).result(timeout=TIMEOUT_S)
        assert len(sample.sequences[0].tokens) == 1
        high_water = _high_water_bytes(pid)
        assert high_water < SAMPLE_HIGH_WATER_BYTES, f"JAX worker memory high-water {high_water / 2**30:.2f} GB"

        s = _tokens(TRAIN_TOKENS + 1, 1)
        datum = types.Datum(model_input=types.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})  # pyright: ignore[reportArgumentType] (Datum converts lists)
        out = training.forward_backward([datum], "cross_entropy").result(timeout=TIMEOUT_S)
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == TRAIN_TOKENS
        assert np.isfinite(out.metrics["loss:sum"])
        high_water = _high_water_bytes(pid)
        assert high_water < TRAIN_HIGH_WATER_BYTES, f"JAX worker memory high-water {high_water / 2**30:.2f} GB"
        assert stack.parts()["jax-worker"]["pid"] == pid  # the same process throughout
    finally:
        stack.stop()
