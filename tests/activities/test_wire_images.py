"""A forward_backward datum's ImageChunks through the worker's converter (activities/wire.py): each becomes its
`expected_tokens` placeholder tokens in the datum's tokens and its patch rows in `Datum.images`, cut by the served
model's image processor exactly as tinkerflow.common.images cuts them; a model without a vision tower, a bad image
or a disagreeing expected_tokens is an InputError naming the datum and the chunk."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tinkerflow.activities import wire, wire_images
from tinkerflow.common.images import ImageProcessing, decode_image, preprocess
from tinkerflow.workers.engine.types import InputError

PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": 4096, "longest_edge": 65536}}
IMAGE_ID = 90
RULES = wire_images.image_rules(PROCESSOR, IMAGE_ID)


def _png(height: int, width: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _input(*chunks, rules=RULES):
    n = sum(c.length for c in chunks)
    datum = types.Datum(
        model_input=types.ModelInput(chunks=list(chunks)),
        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.ones(n, np.int64))},
    )
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"), model_id="m", seq_id=0
    )
    msg = wire.parse_forward_backward(forward_backward_request_to_proto(req).SerializeToString())
    return wire.forward_backward_input(msg, 0, images=rules)


def test_image_chunks_become_placeholders_and_patches():
    png_a, png_b = _png(100, 150), _png(64, 64)
    got = _input(
        types.EncodedTextChunk(tokens=[1, 2]),
        types.ImageChunk(data=png_a, format="png", expected_tokens=15),
        types.ImageChunk(data=png_b, format="png", expected_tokens=4),
        types.EncodedTextChunk(tokens=[3]),
    ).data[0]
    assert got.tokens.tolist() == [1, 2] + [IMAGE_ID] * 19 + [3] and got.tokens.dtype == np.int32
    assert len(got.inputs["target_tokens"]) == len(got.tokens)  # the SDK's length counts expected_tokens
    processing = ImageProcessing.from_hf(PROCESSOR)
    for image, png in zip(got.images, (png_a, png_b), strict=True):
        want = preprocess(decode_image(png, "png"), processing)
        assert image.grid == want.grid
        np.testing.assert_array_equal(image.patches, want.patches)


def test_text_datums_carry_no_images():
    assert _input(types.EncodedTextChunk(tokens=[1, 2, 3])).data[0].images == ()


@pytest.mark.parametrize(
    "chunk, rules, message",
    [
        (types.ImageChunk(data=_png(100, 150), format="png", expected_tokens=15), None, "text-only model"),
        (
            types.ImageChunk(data=_png(100, 150), format="png", expected_tokens=7),
            RULES,
            "datum 0: model_input.chunks[1]: expected_tokens=7 but the image becomes 15 tokens",
        ),
        (
            types.ImageChunk(data=b"not a png" * 20, format="png", expected_tokens=15),
            RULES,
            "datum 0: model_input.chunks[1]: image data is not a valid png image",
        ),
    ],
)
def test_images_the_worker_cannot_take_are_the_senders_error(chunk, rules, message):
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _input(types.EncodedTextChunk(tokens=[1]), chunk, rules=rules)


def _sample(*chunks, rules=RULES):
    request = types.SampleRequest(
        prompt=types.ModelInput(chunks=list(chunks)),
        sampling_params=types.SamplingParams(max_tokens=4),
        num_samples=1,
        prompt_logprobs=True,
    )
    return wire.sample_input(request.model_dump_json().encode(), None, rules)


def test_a_prompts_images_become_placeholders_and_patches_as_a_datums_do():
    png = _png(100, 150)
    chunks = (
        types.EncodedTextChunk(tokens=[1, 2]),
        types.ImageChunk(data=png, format="png", expected_tokens=15),
        types.EncodedTextChunk(tokens=[3]),
    )
    got, datum = _sample(*chunks), _input(*chunks).data[0]
    assert got.prompt.tolist() == datum.tokens.tolist() == [1, 2] + [IMAGE_ID] * 15 + [3]
    assert got.prompt.dtype == np.int32 and got.include_prompt_logprobs
    [image] = got.images
    assert image.grid == datum.images[0].grid
    np.testing.assert_array_equal(image.patches, datum.images[0].patches)
    assert _sample(types.EncodedTextChunk(tokens=[1])).images == ()


@pytest.mark.parametrize(
    "chunk, rules, message",
    [
        (types.ImageChunk(data=_png(100, 150), format="png", expected_tokens=15), None, "text-only model"),
        (
            types.ImageChunk(data=_png(100, 150), format="png", expected_tokens=7),
            RULES,
            "prompt.chunks[1]: expected_tokens=7 but the image becomes 15 tokens",
        ),
        (
            types.ImageChunk(data=b"not a png" * 20, format="png"),
            RULES,
            "prompt.chunks[1]: image data is not a valid png image",
        ),
    ],
)
def test_images_the_sampler_cannot_take_are_the_senders_error(chunk, rules, message):
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _sample(types.EncodedTextChunk(tokens=[1]), chunk, rules=rules)
