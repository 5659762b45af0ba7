"""Sampling through the real stack: many concurrent asample calls, the RL acceptance loop, the sampling surface."""

from __future__ import annotations

import time

import pytest
import tinker
from tinker import types

from tests.e2e.conftest import run_acceptance_script

pytestmark = pytest.mark.e2e


def test_200_concurrent_asample_calls_from_several_clients_all_complete(stack, base_model):
    clients = [tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key) for _ in range(4)]
    samplers = [c.create_sampling_client(base_model=base_model).result() for c in clients]
    tokenizer = clients[0].create_lora_training_client(base_model=base_model, rank=4).result().get_tokenizer()
    prompts = [types.ModelInput.from_ints(tokenizer.encode(f"Tell me a story number {i}:")) for i in range(50)]
    params = types.SamplingParams(max_tokens=8, temperature=1.0, stop=[])
    futures = [s.sample(prompt=p, num_samples=1, sampling_params=params) for s in samplers for p in prompts]
    assert len(futures) == 200
    results = [f.result(timeout=600) for f in futures]
    assert all(len(r.sequences) == 1 and len(r.sequences[0].tokens) == 8 for r in results)
    assert all(len(r.sequences[0].logprobs) == 8 for r in results)  # pyright: ignore[reportArgumentType] (logprobs were asked for)


def test_rl_loop_acceptance_script(stack):
    run_acceptance_script(stack, "rl_loop.py", timeout_s=1200)


def test_full_sampling_queue_answers_429_and_the_sdk_retries_until_all_complete(tmp_path):
    from tinkerflow.cli.launch import launch

    # No warm-up: the first wave must meet a compile (with one, its prompts would round up to a warmed bucket).
    small = launch(tmp_path / "state", api_key="tml-429", extra=["--max-queued-samples", "2", "--warm-up", "off"])
    try:
        client = tinker.ServiceClient(base_url=small.base_url, api_key="tml-429")
        sampler = client.create_sampling_client(base_model=small.served_model()).result()
        params = types.SamplingParams(max_tokens=4, temperature=1.0, stop=[])

        def wave(n: int, offset: int):
            # 20-token prompts: a prompt bucket (24) the JAX worker has not compiled (--warm-up off).
            return [
                sampler.sample(
                    prompt=types.ModelInput.from_ints([5, 6, *range(offset + i, offset + i + 18)]),
                    num_samples=1,
                    sampling_params=params,
                )
                for i in range(n)
            ]

        # The first wave queues up behind the first compile of its prompt bucket; the second finds the queue full
        # (the API checks the depth at most every 250 ms, so a single burst can overshoot the limit).
        futures = wave(10, 10)
        time.sleep(1.5)
        futures += wave(30, 100)
        assert all(len(f.result(timeout=600).sequences[0].tokens) == 4 for f in futures)
        assert "answering 429" in (small.state_dir / "logs" / "api.log").read_text()
    finally:
        small.stop()
