"""Qwen3.5's sampling cache path (families/qwen3_5/cache.py, `CausalLM.hidden(..., cache=...)`): prompts prefilled
into slots (in one chunk or two, ragged lengths, padded tails) and then decoded one token per step give, at every
position, the logits of one full forward over the same sequence, with a different non-zero LoRA per row.

Tolerance: 1e-5 absolute on float32 logits of order one (qwen3_5_reference.py says how the weights keep them there):
the cached path differs from the full forward only in float32 rounding (the chunked delta rule's solve against the
per-token step, attention's online softmax against the one-pass softmax).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from qwen3_5_reference import VOCAB, hf_model, lora_modules, our_model, text_config

from tinkerflow.workers.engine.model.families.qwen3_5.cache import empty_cache, state_bytes_per_slot
from tinkerflow.workers.engine.model.lora import LoraRouting

pytest.importorskip("torch")

# Logits of the decode path (the delta rule token by token, the cache's keys) against one full forward (its chunked
# form), float32 on CPU. 1e-5 held on the host it was measured on; on a 2-core AMD EPYC host (AVX-512) the same code
# (the commit before any change here) gives up to 2.26e-5 on the ragged and two-chunk cases: XLA's CPU kernels sum in
# another order there. A wrong state or a misplaced key moves logits by 1e-2 or more.
ATOL = 3e-5
CACHE_LEN, DECODE_STEPS = 96, 6


@pytest.fixture(scope="module")
def model():
    ours = our_model(hf_model(text_config()), max_adapters=3, max_rank=4)
    rng = np.random.default_rng(7)
    for module in lora_modules(ours).values():
        a, b = module.lora_a[...], module.lora_b[...]
        module.lora_a[...] = jnp.asarray(rng.normal(0.0, 1.0 / np.sqrt(a.shape[-2]), a.shape).astype(np.float32))
        module.lora_b[...] = jnp.asarray(rng.normal(0.0, 0.1, b.shape).astype(np.float32))
    return ours


def _routing(adapters: np.ndarray) -> LoraRouting:
    return LoraRouting(adapter=jnp.asarray(adapters, jnp.int32), scale=jnp.full(adapters.shape, 0.5, jnp.float32))


def _full_logits(model, seq: np.ndarray, adapter: int) -> np.ndarray:
    pos = jnp.arange(len(seq), dtype=jnp.int32)[None]
    return np.asarray(model(jnp.asarray(seq[None]), pos, _routing(np.array([adapter])))[0])


def _check(model, prompt_lens: list[int], split: int | None) -> None:
    b = len(prompt_lens)
    rng = np.random.default_rng(sum(prompt_lens))
    seqs = [rng.integers(0, VOCAB, p + DECODE_STEPS).astype(np.int32) for p in prompt_lens]
    adapters = np.arange(b) % 3
    routing = _routing(adapters)
    rows = jnp.arange(b, dtype=jnp.int32)
    lengths = np.asarray(prompt_lens)
    cache = empty_cache(model.config, b, CACHE_LEN)
    # Prefill: one chunk of the longest prompt, or two (the second resuming each row's state), tails padded.
    bounds = [(0, max(prompt_lens))] if split is None else [(0, split), (split, max(prompt_lens))]
    last: dict[int, np.ndarray] = {}
    for start, end in bounds:
        tokens = np.zeros((b, end - start), np.int32)
        for r, s in enumerate(seqs):
            piece = s[start : min(end, prompt_lens[r])]
            tokens[r, : len(piece)] = piece
        pos = jnp.broadcast_to(jnp.arange(start, end, dtype=jnp.int32), (b, end - start))
        real = np.clip(lengths - start, 0, end - start)
        view = cache.through(rows, jnp.asarray(real, jnp.int32), jnp.full((b,), start == 0))
        h, view = model.hidden(jnp.asarray(tokens), pos, routing, view)
        cache = view.settled()
        logits = np.asarray(model.logits(h, routing))
        for r in range(b):
            if start < prompt_lens[r] <= end:
                last[r] = logits[r, prompt_lens[r] - 1 - start]
    full = [_full_logits(model, s, int(a)) for s, a in zip(seqs, adapters)]
    for r in range(b):
        np.testing.assert_allclose(last[r], full[r][prompt_lens[r] - 1], atol=ATOL, err_msg=f"prefill row {r}")
    # Decode: one token per slot per step over the whole cache, each row at its own position.
    for step in range(DECODE_STEPS):
        pos = lengths + step
        token = np.array([s[p] for s, p in zip(seqs, pos)], np.int32)
        h, cache = model.hidden(jnp.asarray(token[:, None]), jnp.asarray(pos[:, None], jnp.int32), routing, cache)
        logits = np.asarray(model.logits(h, routing))[:, 0]
        for r in range(b):
            np.testing.assert_allclose(logits[r], full[r][pos[r]], atol=ATOL, err_msg=f"decode step {step} row {r}")


def test_one_row_prefill_then_decode(model):
    _check(model, [37], split=None)


@pytest.mark.slow  # eager forwards of many lengths: a minute and more on two cores
def test_eight_ragged_rows(model):
    _check(model, [5, 70, 1, 33, 64, 65, 12, 48], split=None)


@pytest.mark.slow  # eager forwards of many lengths: a minute and more on two cores
def test_prompt_prefilled_in_two_chunks_resumes_the_state(model):
    _check(model, [70, 20, 45, 64], split=32)


def test_fresh_rows_ignore_a_previous_occupant(model):
    """A slot's state from an earlier row is not read by a fresh row (the sampler reuses slots)."""
    b = 2
    rows = jnp.arange(b, dtype=jnp.int32)
    cache = empty_cache(model.config, b, CACHE_LEN)
    cache = cache._replace(conv=cache.conv + 3.0, recurrent=cache.recurrent + 5.0)
    seq = np.arange(1, 11, dtype=np.int32) % VOCAB
    tokens = jnp.asarray(np.stack([seq, seq]))
    pos = jnp.broadcast_to(jnp.arange(10, dtype=jnp.int32), (b, 10))
    view = cache.through(rows, jnp.full((b,), 10, jnp.int32), jnp.array([True, False]))
    h, _ = model.hidden(tokens, pos, _routing(np.zeros(b, np.int64)), view)
    want = _full_logits(model, seq, 0)[-1]
    got = np.asarray(model.logits(h, _routing(np.zeros(b, np.int64))))[:, -1]
    np.testing.assert_allclose(got[0], want, atol=ATOL)
    assert np.abs(got[1] - want).max() > 1e-2  # the stale state was read: the fresh flag is what kept row 0 exact


def test_state_bytes_per_slot_is_the_cache_arrays():
    from tinkerflow.workers.engine.model.families.qwen3_5.config import Qwen35Config

    config = Qwen35Config.from_hf(text_config().to_dict())
    cache = empty_cache(config, 3, 16)
    assert state_bytes_per_slot(config) * 3 == cache.conv.nbytes + cache.recurrent.nbytes
