"""Qwen3-VL's causal LM as the sampler calls it (`hidden(..., cache, prompt_images=)`): a prompt with two images
prefilled in chunks into a KV cache, each prompt token carrying the tower's `image_features` at its placeholder (its
feature and its DeepStack features side by side) and its 3-D positions, then one decode step at its position plus
the rope delta, equals the training forward (`hidden(..., images=)`, checked against transformers in
test_qwen3_vl_vision_training.py) on the same tokens, with either of the sampler's layer loops (the scan, or unrolled
with the DeepStack additions at constant layer indices).

The first chunk ends inside the second image, so an image's features and DeepStack additions are split over two
chunks. Tolerance: 1e-5 absolute plus 1e-5 relative on the logits, the text sampler's: the paths differ only in float32
rounding (the cached attention against the one-pass one); a wrong position or a missing DeepStack addition moves
logits by far more.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from qwen3_vl_checkpoint import PATCH, TEMPORAL, build_qwen3_vl

from tinkerflow.common.images import ProcessedImage
from tinkerflow.workers.engine.engine import Engine
from tinkerflow.workers.engine.model.families.qwen3_5.vision_batch import image_batch
from tinkerflow.workers.engine.model.image_inputs import PromptImages
from tinkerflow.workers.engine.model.kv_cache import empty_cache
from tinkerflow.workers.engine.model.lora import LoraRouting

ATOL = RTOL = 1e-5
GRIDS = [(1, 4, 6), (1, 8, 6)]  # 6 and 12 placeholders
CHUNK = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine.load(str(build_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"), moe=False)), progress=False)


@pytest.mark.parametrize("layers", ["scan", "unrolled"])  # the sampler's layer loops (model/decoder_stack.py)
def test_chunked_prefill_and_decode_with_images_equal_the_training_forward(engine, layers):
    config = engine.config
    image_id = engine.info.image_token_id
    rng = np.random.default_rng(11)
    images = [
        ProcessedImage(rng.uniform(-1, 1, (t * h * w, 3 * TEMPORAL * PATCH**2)).astype(np.float32), (t, h, w), 2)
        for t, h, w in GRIDS
    ]
    start, end = image_id - 2, image_id - 1

    def text(n: int) -> list[int]:
        return rng.integers(0, start, n).tolist()

    prompt = text(3) + [start] + [image_id] * 6 + [end] + text(2) + [start] + [image_id] * 12 + [end] + text(4)
    token = text(1)
    full = np.asarray([prompt + token], np.int32)
    p = len(prompt)
    assert p > CHUNK and full[0, CHUNK - 1] == image_id == full[0, CHUNK]  # the chunk boundary splits an image

    model = nnx.merge(engine._graphdef, engine.adapters.lora, engine.base)
    model.decode_layers = layers  # calls with a cache run it; the training forward below always scans
    routing = LoraRouting(jnp.asarray([0], jnp.int32), jnp.asarray([0.0], jnp.float32))
    batch = image_batch(config, full, np.ones_like(full), images)
    want_h, _ = model.hidden(jnp.asarray(full), jnp.asarray(np.arange(p + 1)[None]), routing, images=batch)
    want = np.asarray(model.logits(want_h, routing))[0]

    features = np.asarray(model.image_features(batch.patches, batch.vision))
    assert features.shape[1] == config.image_feature_size == 3 * config.hidden_size
    is_image = full[0] == image_id
    per_token = np.zeros((p + 1, features.shape[1]), np.float32)
    per_token[is_image] = features[: int(is_image.sum())]
    positions = np.asarray(batch.positions)[0]  # [T, 3]
    delta = int(positions[:p].max()) + 1 - p
    np.testing.assert_array_equal(positions[p], p + delta)  # the generated token's position on every axis

    cache = empty_cache(config, 2, 64)
    rows = jnp.asarray([1], jnp.int32)
    got = []
    for a, b in [(0, CHUNK), (CHUNK, p)]:
        view = cache.through(rows, jnp.asarray([b - a]), jnp.asarray([a == 0]))
        images_in = PromptImages(
            features=jnp.asarray(per_token[None, a:b]),
            mask=jnp.asarray(is_image[None, a:b]),
            positions=jnp.asarray(positions[None, a:b]),
        )
        h, view = model.hidden(
            jnp.asarray(full[:, a:b]), jnp.asarray(np.arange(a, b)[None]), routing, view, prompt_images=images_in
        )
        cache = view.settled()
        got.append(np.asarray(model.logits(h, routing))[0])
    decode_images = PromptImages(  # as the decode step: no placeholder, features of the hidden width only
        features=jnp.zeros((1, 1, config.hidden_size), jnp.float32),
        mask=jnp.zeros((1, 1), bool),
        positions=jnp.full((1, 1, 3), p + delta, jnp.int32),
    )
    h, _ = model.hidden(
        jnp.asarray(full[:, p:]),
        jnp.asarray([[p]]),
        routing,
        cache.through(rows, jnp.asarray([1]), jnp.asarray([False])),
        prompt_images=decode_images,
    )
    got.append(np.asarray(model.logits(h, routing))[0])
    np.testing.assert_allclose(np.concatenate(got), want, atol=ATOL, rtol=RTOL)


def test_sampled_logprobs_with_images_equal_the_forward(engine):
    """Through the engine's sampler: a prompt with an image and a text prompt, sampled together; every sampled
    token's logprob is the training forward's of the same sequence with its images (the sampler keeps each
    placeholder's DeepStack features beside its feature, `image_inputs.tower_features`)."""
    import jax

    from tinkerflow.workers.engine.types import SampleInput, SampleResult

    image_id = engine.info.image_token_id
    assert image_id is not None
    rng = np.random.default_rng(5)
    image = ProcessedImage(rng.uniform(-1, 1, (24, 3 * TEMPORAL * PATCH**2)).astype(np.float32), (1, 4, 6), 2)
    prompts = [
        (np.asarray([3, 4, image_id - 2] + [image_id] * 6 + [image_id - 1, 7, 8], np.int32), (image,)),
        (np.asarray([9, 10, 11, 12, 13], np.int32), ()),
    ]
    engine.sample_slots = 4
    requests = [
        SampleInput(prompt=p, max_tokens=6, seed=5, stop_token_ids=[image_id], images=its) for p, its in prompts
    ]
    model = nnx.merge(engine._graphdef, engine.adapters.lora, engine.base)
    routing = LoraRouting(jnp.asarray([0], jnp.int32), jnp.asarray([0.0], jnp.float32))
    for (prompt, its), res in zip(prompts, engine.sample(requests), strict=True):
        assert isinstance(res, SampleResult), res
        [seq] = res.sequences
        full = np.concatenate([prompt, np.asarray(seq.tokens, np.int32)])[None, :-1]
        batch = image_batch(engine.config, full, np.ones_like(full), list(its)) if its else None
        h, _ = model.hidden(jnp.asarray(full), jnp.arange(full.shape[1])[None], routing, images=batch)
        lp = np.asarray(jax.nn.log_softmax(model.logits(h, routing)[0], axis=-1))[len(prompt) - 1 :]
        want = lp[np.arange(len(seq.tokens)), np.asarray(seq.tokens)]
        np.testing.assert_allclose(seq.logprobs, want, atol=ATOL, rtol=RTOL)
