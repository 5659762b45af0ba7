"""The JAX worker compiles its sampler before it takes work: after `start_engine` (what `jax_worker.serve` runs
before it registers), samples of the warmed shapes compile nothing, whatever the batch size."""

from __future__ import annotations

import numpy as np
from conftest import MAX_ADAPTERS, MAX_RANK

from tinkerflow.common.settings import Settings
from tinkerflow.workers import jax_worker
from tinkerflow.workers.engine.types import LoraConfig, SampleInput, SampleResult, SamplerWarmUp

PROMPT = np.array([5, 17, 42, 99, 7], np.int32)


def test_a_warmed_worker_engine_compiles_nothing_for_its_first_samples(qwen3_dir):
    settings = Settings(max_lora_adapters=MAX_ADAPTERS, max_lora_rank=MAX_RANK)
    engine = jax_worker.start_engine(settings, str(qwen3_dir))  # the worker's default warm-up
    assert SamplerWarmUp() == SamplerWarmUp(cache_lens=(128,), prompt_lens=(16,), num_adapters=(1,))
    sampler = engine._sampler
    warmed = sampler.compile_count()
    # admit + decode per slot bucket (8, 64, 256), and the empty slots of each
    assert warmed == 3 * len(sampler.buckets()), warmed

    engine.create_adapter(0, LoraConfig(rank=4, seed=3))
    engine.snapshot(0, "warm")
    base = engine.sample([SampleInput(prompt=PROMPT, max_tokens=8, seed=1)])[0]
    lora = engine.sample([SampleInput(prompt=PROMPT, max_tokens=8, seed=1, snapshot="warm")])[0]
    # a coordinator batch of another size (another slot bucket), some rows near the prompt bucket's edge
    many = engine.sample([SampleInput(prompt=np.arange(1, 3 + i % 14, dtype=np.int32), num_samples=3, max_tokens=20,
                                      seed=i, snapshot="warm" if i % 2 else None) for i in range(30)])  # fmt: skip
    assert sampler.compile_count() == warmed
    assert isinstance(base, SampleResult) and isinstance(lora, SampleResult), (base, lora)
    assert all(isinstance(r, SampleResult) for r in many), many
    assert len(base.sequences[0].tokens) >= 1 and len(lora.sequences[0].tokens) >= 1
    assert all(isinstance(r, SampleResult) and len(r.sequences) == 3 for r in many)
    # The same again: warm-up of shapes already compiled compiles nothing.
    assert engine.warm_up_sampler() == 0
