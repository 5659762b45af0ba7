"""The slot sampler over Qwen3.5's hybrid cache (model/slot_cache.py, families/qwen3_5/cache.py): the logprob of
every sampled token equals the full forward's log-softmax at that position for the same sequence, at 1, 8 and 64
rows (more rows than a bucket's admission, so slots are prefilled in several admissions and reused after their
rows finish), prompts longer than one admission chunk (the state carried from chunk to chunk), a non-zero LoRA on
some rows and the base model on others.

The family is not registered in this branch: the test answers its `cache_kinds` (linear layers "recurrent", full
attention "kv") where the sampling side asks. Tolerance: 1e-5 absolute plus 1e-5 relative on float32 logprobs of
magnitude up to ~6: the sampler's path differs from the full forward only in float32 rounding (the adapter stack's
dense matmuls, prompt chunks of 128 against one pass, the decode step against the chunked delta rule), which over
64 rows reached 1.24e-5 at a logprob of -3.87 (about 26 float32 ulps there); a wrong state (a stale slot, padding
in the recurrence) moves logprobs by 1e-2 and more (test_qwen3_5_decode.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from qwen3_5_reference import VOCAB, hf_model, lora_modules, our_model, text_config

from tinkerflow.workers.engine.model import slot_cache
from tinkerflow.workers.engine.model.families.qwen3_5.config import LINEAR_ATTENTION
from tinkerflow.workers.engine.model.lora import LoraRouting
from tinkerflow.workers.engine.model.sharding import DeviceLayout, MeshConfig, as_mesh
from tinkerflow.workers.engine.sampling.rows import SampleRow
from tinkerflow.workers.engine.sampling.sampler import SlotSampler

pytest.importorskip("torch")

ATOL = RTOL = 1e-5
SCALE = 0.5


@pytest.fixture(scope="module")
def model():
    ours = our_model(hf_model(text_config()), max_adapters=1, max_rank=4)
    rng = np.random.default_rng(11)
    for module in lora_modules(ours).values():
        a, b = module.lora_a[...], module.lora_b[...]
        module.lora_a[...] = jnp.asarray(rng.normal(0.0, 1.0 / np.sqrt(a.shape[-2]), a.shape).astype(np.float32))
        module.lora_b[...] = jnp.asarray(rng.normal(0.0, 0.1, b.shape).astype(np.float32))
    return ours


@pytest.fixture(scope="module")
def sampler(model):
    config = model.config
    kinds = tuple("recurrent" if k == LINEAR_ATTENTION else "kv" for k in config.layer_types)
    patch = pytest.MonkeyPatch()
    patch.setattr(slot_cache, "family_named", lambda name: SimpleNamespace(cache_kinds=lambda c: kinds))
    graphdef, _, _ = nnx.split(model, nnx.LoRAParam, ...)
    placement = DeviceLayout(as_mesh(MeshConfig(fsdp=1, tp=1)), config)
    s = SlotSampler(graphdef, placement, config, jnp.float32, tokenizer=None)
    s.max_slots, s.eager_buckets = 64, False
    yield s
    patch.undo()


def _rows(n: int, seed: int) -> list[SampleRow]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 150))).astype(np.int32)
        rows.append(
            SampleRow(
                prompt=prompt,
                max_tokens=int(rng.integers(1, 12)),
                temperature=1.0,
                top_k=-1,
                top_p=1.0,
                seed=(seed, i),
                sample_index=0,
                stop_ids=[],
                adapter=i % 2 - 1,
                scale=SCALE,
            )
        )
    return rows


def _reference_logprobs(model, row: SampleRow, tokens: list[int]) -> np.ndarray:
    seq = np.concatenate([row.prompt, np.asarray(tokens, np.int32)])
    routing = LoraRouting(
        adapter=jnp.asarray([max(row.adapter, 0)], jnp.int32),
        scale=jnp.asarray([SCALE if row.adapter >= 0 else 0.0], jnp.float32),
    )
    logits = model(jnp.asarray(seq[None, :-1]), jnp.arange(len(seq) - 1, dtype=jnp.int32)[None], routing)[0]
    lp = jax.nn.log_softmax(logits, axis=-1)
    p = len(row.prompt)
    return np.asarray(lp[p - 1 :][np.arange(len(tokens)), np.asarray(tokens)])


@pytest.mark.parametrize("n", [1, 8, 64])
def test_sampled_logprobs_equal_the_forward(model, sampler, n):
    _, lora, base = nnx.split(model, nnx.LoRAParam, ...)
    rows = _rows(n, seed=n)
    out = sampler.run(rows, lora, base)
    for i, (row, res) in enumerate(zip(rows, out, strict=True)):
        assert len(res.tokens) == row.max_tokens and res.stop_reason == "length"
        assert res.cache_hit_tokens == 0
        want = _reference_logprobs(model, row, res.tokens)
        np.testing.assert_allclose(res.logprobs, want, atol=ATOL, rtol=RTOL, err_msg=f"row {i} of {n}")


def test_rows_reusing_freed_slots_start_from_zero_state(model, sampler):
    """More rows than slots: later rows take slots earlier ones freed, whose states they must not read."""
    _, lora, base = nnx.split(model, nnx.LoRAParam, ...)
    rows = _rows(20, seed=5)
    sampler.max_slots = 8
    try:
        out = sampler.run(rows, lora, base)
    finally:
        sampler.max_slots = 64
    for i, (row, res) in enumerate(zip(rows, out, strict=True)):
        want = _reference_logprobs(model, row, res.tokens)
        np.testing.assert_allclose(res.logprobs, want, atol=ATOL, rtol=RTOL, err_msg=f"row {i} of 20")
