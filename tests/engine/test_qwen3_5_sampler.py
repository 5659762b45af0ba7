"""The slot sampler over Qwen3.5's hybrid cache (model/slot_cache.py, families/qwen3_5/cache.py): the logprob of
every sampled token equals the full forward's log-softmax at that position for the same sequence, at 1, 8 and 64
rows (more rows than a bucket's admission, so slots are prefilled in several admissions and reused after their
rows finish), prompts longer than one admission chunk (the state carried from chunk to chunk), a non-zero LoRA on
some rows and the base model on others; and the same for rows that resume from the prefix cache's blocks and
recurrent-state snapshots (sampling/prefix_cache.py).

Tolerance: 1e-5 absolute plus 1e-5 relative on float32 logprobs of
magnitude up to ~6: the sampler's path differs from the full forward only in float32 rounding (the adapter stack's
dense matmuls, prompt chunks of 128 against one pass, the decode step against the chunked delta rule), which over
64 rows reached 1.24e-5 at a logprob of -3.87 (about 26 float32 ulps there); a wrong state (a stale slot, padding
in the recurrence) moves logprobs by 1e-2 and more (test_qwen3_5_decode.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from qwen3_5_reference import VOCAB, hf_model, lora_modules, our_model, text_config
from sample_rows import sample_row

from tinkerflow.workers.engine.model import slot_cache
from tinkerflow.workers.engine.model.lora import LoraRouting
from tinkerflow.workers.engine.model.sharding import DeviceLayout, MeshConfig, as_mesh
from tinkerflow.workers.engine.sampling import admission
from tinkerflow.workers.engine.sampling.admission import NO_STATE
from tinkerflow.workers.engine.sampling.prefix_cache import BLOCK, PrefixIndex
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


def _sampler(model, prefix_tokens: int = 0):
    config = model.config
    assert slot_cache.recurrent(config), "the family answers its linear layers' cache kind itself"
    graphdef, _, _ = nnx.split(model, nnx.LoRAParam, ...)
    placement = DeviceLayout(as_mesh(MeshConfig(fsdp=1, tp=1)), config)
    s = SlotSampler(graphdef, placement, config, jnp.float32, tokenizer=None)
    s.max_slots, s.eager_buckets, s.prefix_tokens = 64, False, prefix_tokens
    yield s


@pytest.fixture(scope="module")
def sampler(model):
    yield from _sampler(model)


@pytest.fixture(scope="module")
def caching(model):
    """A sampler with a prefix cache of 4,096 tokens (its state snapshots with it)."""
    yield from _sampler(model, prefix_tokens=4096)


def _rows(n: int, seed: int, shared: np.ndarray | None = None) -> list[SampleRow]:
    """`n` rows of random prompts (after `shared`, when given: then each in the prefix cache's namespace of its
    adapter), alternately on the base model and the LoRA."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 150))).astype(np.int32)
        if shared is not None:
            prompt = np.concatenate([shared, prompt])
        rows.append(
            sample_row(
                prompt,
                max_tokens=int(rng.integers(1, 12)),
                seed=(seed, i),
                adapter=i % 2 - 1,
                scale=SCALE,
                cache_namespace=None if shared is None else ("shared", seed, i % 2),
            )
        )
    return rows


# The reference forward runs jitted over the sequence padded to a multiple of PAD tokens (the model is causal: what
# follows a position changes nothing at it), so a module compiles a few lengths instead of running each row's
# forward op by op (seconds a row on two cores).
PAD = 64


@nnx.jit
def _forward_logprobs(model, tokens: jax.Array, positions: jax.Array, routing: LoraRouting) -> jax.Array:
    return jax.nn.log_softmax(model(tokens, positions, routing), axis=-1)


def _reference_logprobs(model, row: SampleRow, tokens: list[int]) -> np.ndarray:
    seq = np.concatenate([row.prompt, np.asarray(tokens, np.int32)])[:-1]
    padded = np.zeros(-(-len(seq) // PAD) * PAD, np.int32)
    padded[: len(seq)] = seq
    routing = LoraRouting(
        adapter=jnp.asarray([max(row.adapter, 0)], jnp.int32),
        scale=jnp.asarray([SCALE if row.adapter >= 0 else 0.0], jnp.float32),
    )
    positions = jnp.arange(len(padded), dtype=jnp.int32)[None]
    lp = _forward_logprobs(model, jnp.asarray(padded[None]), positions, routing)[0]
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


@pytest.mark.parametrize("n", [1, 8, 64])
def test_rows_resuming_from_the_prefix_cache_sample_the_forward(model, caching, n):
    """A first call prefills a 150-token prefix on each adapter (longer than one admission chunk), snapshotting the
    state at its last whole block; every row of the next call shares that prefix and resumes there."""
    _, lora, base = nnx.split(model, nnx.LoRAParam, ...)
    shared = np.random.default_rng(1000 + n).integers(0, VOCAB, 150).astype(np.int32)
    first = [dataclasses.replace(r, prompt=shared, needs_from=len(shared) - 1) for r in _rows(2, n, shared)]
    assert [r.cache_hit_tokens for r in caching.run(first, lora, base)] == [0, 0]
    rows = _rows(n, seed=n, shared=shared)
    out = caching.run(rows, lora, base)
    for i, (row, res) in enumerate(zip(rows, out, strict=True)):
        assert res.cache_hit_tokens == len(shared) // BLOCK * BLOCK, f"row {i} of {n}"
        want = _reference_logprobs(model, row, res.tokens)
        np.testing.assert_allclose(res.logprobs, want, atol=ATOL, rtol=RTOL, err_msg=f"row {i} of {n}")


def test_a_recurrent_prefix_index_resumes_only_where_a_snapshot_is():
    """Hits end at the last cached block with a state snapshot; with every state slot taken, the least recently
    used block's snapshot gives way (the block stays), never a pinned one's; an evicted block frees its state."""
    index = PrefixIndex(blocks=6, states=1)
    a = np.arange(3 * BLOCK + 5, dtype=np.int32)
    wa = index.plan_writes("ns", a, [], set())
    assert wa == [0, 1, 2] and index.lookup("ns", a, len(a) - 1) == []  # blocks, but nowhere to resume
    assert index.plan_state(wa[1], set()) == 0
    assert index.lookup("ns", a, len(a) - 1) == [0, 1] and index.state_of(1) == 0
    b = np.full(2 * BLOCK + 1, 7, np.int32)
    wb = index.plan_writes("ns", b, [], set())
    assert index.plan_state(wb[0], set()) == 0  # a's block 1 was used least recently
    assert index.lookup("ns", a, len(a) - 1) == [] and index.lookup("ns", b, len(b) - 1) == [wb[0]]
    assert index.plan_state(wa[2], {wb[0]}) == -1  # the one snapshot is pinned
    small = PrefixIndex(blocks=1, states=1)
    x, y = np.full(BLOCK + 1, 3, np.int32), np.full(BLOCK + 1, 4, np.int32)
    [wx] = small.plan_writes("ns", x, [], set())
    assert small.plan_state(wx, set()) == 0 and small.lookup("ns", x, BLOCK) == [wx]
    assert small.plan_writes("ns", y, [], set()) == [wx]  # x's block evicted, and its snapshot with it
    assert small.lookup("ns", x, BLOCK) == [] and small.plan_state(wx, set()) == 0


def test_a_row_pauses_its_prefill_at_the_boundary_it_snapshots():
    """Its chunk reaching the block boundary before its last token ends there and snapshots the state; the next
    chunk prefills the rest. The same prompt again resumes there and computes only what follows."""
    index = PrefixIndex(blocks=32, states=4)
    prompt = np.arange(100, dtype=np.int32)
    row = sample_row(prompt)
    c, r, cache, slots, pool = 64, 2, 256, 8, 32
    adm = admission.plan([row], [0], [3], index)
    assert adm.pauses == [96] and adm.snaps[0] >= 0 and adm.resumes == [-1]
    chunks = list(adm.chunks([row], r, c, cache, slots, pool))
    assert [(x.start[0], x.prompt_len[0], x.final[0]) for x in chunks] == [
        (0, 64, False),
        (64, 96, False),
        (96, 100, True),
    ]
    assert [x.snap[0] for x in chunks] == [NO_STATE, adm.snaps[0], NO_STATE]
    assert [(x.write[0] < pool).sum() for x in chunks] == [4, 2, 0]
    assert (chunks[1].chunk[0, 32:] == 0).all()  # past the pause: padding, not the prompt's next tokens
    again = admission.plan([row], [0], [4], index)
    assert again.starts == [96] and again.resumes == adm.snaps and again.pauses == [0]
    [chunk] = again.chunks([row], r, c, cache, slots, pool)
    assert chunk.start[0] == 96 and chunk.resume[0] == adm.snaps[0] and chunk.cached[0] == 96 and chunk.final[0]
