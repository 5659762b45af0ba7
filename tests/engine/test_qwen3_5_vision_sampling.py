"""Sampling prompts with images on Qwen3.5 VL: the prefix cache keys the blocks holding an image's placeholders on
the image's digest, so the same tokens with another image never hit."""

from __future__ import annotations

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from vision_layouts import layouts, processed_images

from tinkerflow.workers.engine.engine import Engine
from tinkerflow.workers.engine.model.families.qwen3_5.vision_batch import image_batch
from tinkerflow.workers.engine.model.lora import LoraRouting
from tinkerflow.workers.engine.model.tiny_model import make_tiny_model
from tinkerflow.workers.engine.runtime.aot_cache import abstract
from tinkerflow.workers.engine.sampling.prefix_cache import BLOCK, PrefixIndex
from tinkerflow.workers.engine.types import SampleInput, SampleResult


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def test_prefix_blocks_holding_an_image_key_on_its_digest():
    """Same tokens, same image: every whole block hits. Same tokens, another image of the same size: the blocks
    before the image still hit, the block holding its placeholders and every one after it miss."""
    index = PrefixIndex(blocks=16)
    prompt = np.arange(4 * BLOCK + 3, dtype=np.int32)
    span = (BLOCK + 5, 2 * BLOCK + 9)  # the placeholders reach into blocks 1 and 2
    cat, dog = [(*span, _digest(b"cat"))], [(*span, _digest(b"dog"))]
    written = index.plan_writes("ns", prompt, [], set(), images=cat)
    assert written == [0, 1, 2, 3]
    assert index.lookup("ns", prompt, len(prompt) - 1, images=cat) == written
    assert index.lookup("ns", prompt, len(prompt) - 1, images=dog) == written[:1]
    assert index.lookup("ns", prompt, len(prompt) - 1) == written[:1]  # no image at all: the text-only key
    again = index.plan_writes("ns", prompt, written[:1], set(), images=dog)
    assert len(again) == 3 and not set(again) & set(written)  # the other image's blocks are its own
    assert index.lookup("ns", prompt, len(prompt) - 1, images=dog) == [written[0], *again]


# Sampling through the engine on the tiny vision-language checkpoint (float32, CPU), against the training forward
# (`CausalLM.hidden(images=)`, checked against transformers in test_qwen3_5_vision_training.py) of each sampled
# sequence. Tolerance: 1e-5 absolute plus 1e-5 relative, the text sampler's (test_qwen3_5_sampler.py): the sampler's
# path differs from one forward only in float32 rounding (the tower run alone, prompt chunks, the decode step against
# the chunked delta rule); a wrong rotary position or a missing feature moves logprobs by far more.
ATOL = RTOL = 1e-5
# (height, width): 15, 4 and 40 placeholder tokens under the tiny model's processor
SIZES = [(100, 150), (64, 64), (250, 160)]


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_vl") / "qwen3_5_vl", family="qwen3_5", vision=True)


@pytest.fixture(scope="module")
def engine(tiny_vl):
    engine = Engine.load(str(tiny_vl), max_lora_adapters=2, max_lora_rank=8, progress=False)
    engine.sample_slots = 8
    return engine


@pytest.fixture(scope="module")
def images(tiny_vl):
    return processed_images(tiny_vl, SIZES)


def _prompts(engine: Engine, images: list) -> list[tuple[np.ndarray, tuple]]:
    """vision_layouts' three prompts: one image between text; two images of different sizes; text only."""
    image_id = engine.info.image_token_id
    assert image_id is not None
    return layouts(image_id, images, np.random.default_rng(7), vocab=1800)


def _request(engine: Engine, prompt: np.ndarray, its: tuple, **fields) -> SampleInput:
    # A sampled placeholder token stops the row: the forward of the scored sequence never holds one past the prompt.
    image_id = engine.info.image_token_id
    assert image_id is not None
    return SampleInput(prompt=prompt, max_tokens=8, seed=5, stop_token_ids=[image_id], images=its, **fields)


def _forward_logprobs(engine: Engine, prompt: np.ndarray, its: tuple, tokens: list[int]) -> np.ndarray:
    """The training forward's logprobs of `tokens` after `prompt` (base model)."""
    seq = np.concatenate([prompt, np.asarray(tokens, np.int32)])[None, :-1]
    n = seq.shape[1]
    batch = image_batch(engine.config, seq, np.ones_like(seq), list(its)) if its else None
    model = nnx.merge(engine._graphdef, engine.adapters.lora, engine.base)
    routing = LoraRouting(jnp.asarray([0], jnp.int32), jnp.asarray([0.0], jnp.float32))
    positions = jnp.arange(n, dtype=jnp.int32)[None]
    h, _ = model.hidden(jnp.asarray(seq), positions, routing, images=batch)
    lp = np.asarray(jax.nn.log_softmax(model.logits(h, routing)[0], axis=-1))
    p = len(prompt)
    return lp[p - 1 :][np.arange(len(tokens)), np.asarray(tokens)]


def test_sampled_logprobs_with_images_equal_the_forward(engine, images):
    """One image, two images of different sizes and a text row, sampled together (one admission): every sampled
    token's logprob is the forward's of the same sequence with its images."""
    prompts = _prompts(engine, images)
    results = engine.sample([_request(engine, p, its) for p, its in prompts])
    for i, ((prompt, its), res) in enumerate(zip(prompts, results, strict=True)):
        assert isinstance(res, SampleResult), res
        [seq] = res.sequences
        assert seq.tokens
        want = _forward_logprobs(engine, prompt, its, seq.tokens)
        np.testing.assert_allclose(seq.logprobs, want, atol=ATOL, rtol=RTOL, err_msg=f"prompt {i}")


def test_a_prefix_hit_with_the_same_image_resumes_exactly(engine, images):
    """The same prompt and image again in one cache namespace: its blocks come from the prefix cache (the image's
    among them) and the same seed samples the same tokens with the same logprobs; another image of the same size
    hits only the blocks before its placeholders."""
    prompt, its = _prompts(engine, images)[1]
    first, again = (engine.sample([_request(engine, prompt, its, cache_namespace="vl")])[0] for _ in range(2))
    assert isinstance(first, SampleResult) and isinstance(again, SampleResult)
    image_start = int(np.flatnonzero(prompt == engine.info.image_token_id)[0])
    assert first.prompt_cache_hit_tokens == 0
    assert again.prompt_cache_hit_tokens == (len(prompt) - 1) // BLOCK * BLOCK > image_start
    assert again.sequences[0].tokens == first.sequences[0].tokens
    np.testing.assert_allclose(again.sequences[0].logprobs, first.sequences[0].logprobs, atol=ATOL, rtol=RTOL)
    other = (its[0], dataclasses.replace(its[1], patches=its[1].patches[::-1].copy()))
    [res] = engine.sample([_request(engine, prompt, other, cache_namespace="vl")])
    assert isinstance(res, SampleResult)
    assert res.prompt_cache_hit_tokens == image_start // BLOCK * BLOCK
    np.testing.assert_allclose(
        res.sequences[0].logprobs,
        _forward_logprobs(engine, prompt, other, res.sequences[0].tokens),
        atol=ATOL,
        rtol=RTOL,
    )


def test_prompt_logprobs_with_images_equal_the_forward(engine, images):
    """compute_logprobs (a sample asking for prompt logprobs) on prompts with images and a text prompt together:
    every prompt position's logprob is the forward's, placeholders' own among them."""
    prompts = _prompts(engine, images)
    requests = [_request(engine, p, its, include_prompt_logprobs=True) for p, its in prompts]
    for i, ((prompt, its), res) in enumerate(zip(prompts, engine.sample(requests), strict=True)):
        assert isinstance(res, SampleResult) and res.prompt_logprobs is not None, res
        assert res.prompt_logprobs[0] is None
        want = _forward_logprobs(engine, prompt[:1], its, prompt[1:].tolist())
        got = np.asarray(res.prompt_logprobs[1:], np.float64)  # no None past position 0 (no cache hit)
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL, err_msg=f"prompt {i}")


def _tower_calls(engine: Engine, monkeypatch) -> list[str]:
    """The labels of the sampler's tower calls from now on, in order."""
    programs = engine.sampler.programs
    calls: list[str] = []
    tower = programs.tower

    def counted(label, *args):
        calls.append(label)
        return tower(label, *args)

    monkeypatch.setattr(programs, "tower", counted)
    return calls


def test_samples_of_one_request_run_the_tower_once(engine, images, monkeypatch):
    """Three samples of a prompt whose image lies in the prefix cache's blocks: the first runs the tower, the others
    resume from its blocks without it, and every one's logprobs are the forward's."""
    prompt, its = _prompts(engine, images)[0]
    prompt = np.concatenate([prompt, np.arange(100, 120, dtype=np.int32)])
    calls = _tower_calls(engine, monkeypatch)
    [res] = engine.sample([_request(engine, prompt, its, cache_namespace="once", num_samples=3)])
    assert isinstance(res, SampleResult) and len(res.sequences) == 3
    assert len(calls) == 1
    for j, seq in enumerate(res.sequences):
        want = _forward_logprobs(engine, prompt, its, seq.tokens)
        np.testing.assert_allclose(seq.logprobs, want, atol=ATOL, rtol=RTOL, err_msg=f"sample {j}")


def test_rows_sharing_an_image_in_one_call_run_the_tower_once(engine, images, monkeypatch):
    """Two requests of one call with the same prompt and image, outside any prefix cache (so neither resumes from
    the other's blocks): the tower runs once, its features found again by the image's digest, and each row's
    logprobs are the forward's."""
    prompt, its = _prompts(engine, images)[0]
    calls = _tower_calls(engine, monkeypatch)
    results = engine.sample([_request(engine, prompt, its) for _ in range(2)])
    assert len(calls) == 1
    for res in results:
        assert isinstance(res, SampleResult)
        [seq] = res.sequences
        np.testing.assert_allclose(
            seq.logprobs, _forward_logprobs(engine, prompt, its, seq.tokens), atol=ATOL, rtol=RTOL
        )


def test_the_tower_compiles_once_per_patch_bucket(engine, images):
    """Every image of this file fits the smallest patch bucket: a warm-up from shapes of a larger snapshot stack
    (another LoRA stack than the calls above used) finds the tower's program built, since the tower carries no
    LoRA; a text chunk on this model reuses one device block of zero features per chunk shape."""
    programs = engine.sampler.programs
    assert programs.tower.compiled_count == 1
    lora = engine.sampler_snapshots.stack_spec(4)
    engine.sampler.warm_up(lora, abstract(engine.base), buckets=(engine.sampler.buckets()[0].slots,), from_shapes=True)
    assert programs.tower.compiled_count == 1
    assert programs._zeros and not any(np.asarray(z).any() for z in programs._zeros.values())
