"""ImageChunks as the API checks them (platform/api/image_checks.py), in the bodies the unmodified SDK encodes: each
bad image is a problem naming the datum, the chunk and the field or limit; a text-only model refuses images by name;
a good image on a vision model passes, for training and for a sample prompt alike."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tinkerflow.api.image_checks import (
    forward_backward_images,
    images_problem,
    prompt_images,
)
from tinkerflow.common.images import MAX_IMAGE_PIXELS, MAX_IMAGES_PER_DATUM, ImageProcessing, token_count
from tinkerflow.workflows.protocol.messages import ModelCard

PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "size": {"shortest_edge": 4096, "longest_edge": 65536}}
VL = ModelCard("tiny-vl", "qwen3_5", "", 2048, 2048, image_processor=PROCESSOR)
TEXT = ModelCard("tiny-text", "qwen3", "", 2048, 2048)


def _png(height: int, width: int) -> bytes:
    """Noise, so the pixel data is most of the file and cutting it truncates the image."""
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), np.uint8)).save(out, format="PNG")
    return out.getvalue()


def _tokens(height: int, width: int) -> int:
    return token_count(height, width, ImageProcessing.from_hf(PROCESSOR))


def _tensor(values: list[float]) -> types.TensorData:
    return types.TensorData.from_numpy(np.asarray(values, np.float32))


def _body(*chunk_lists: list) -> bytes:
    data = [
        types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs={"weights": _tensor([1.0, 1.0])})
        for chunks in chunk_lists
    ]
    request = types.ForwardBackwardRequest(
        model_id="m", seq_id=1, forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy")
    )
    return forward_backward_request_to_proto(request).SerializeToString()


# Where the chunk sits in each request kind: the second datum of a forward_backward, or a sample prompt.
WHERE = {"train": "datum 1: model_input.chunks[1]", "sample": "prompt: chunks[1]"}


def _problem(chunk: types.ImageChunk, card: ModelCard = VL, *, op: str = "train") -> str:
    text = types.EncodedTextChunk(tokens=[1, 2])
    if op == "sample":
        return images_problem(prompt_images([text, chunk]), card)
    return images_problem(forward_backward_images(_body([text], [text, chunk])), card)


def test_images_are_found_where_the_sdk_puts_them():
    png = _png(100, 150)
    body = _body(
        [types.EncodedTextChunk(tokens=[1, 2])],
        [types.EncodedTextChunk(tokens=[3]), types.ImageChunk(data=png, format="png", expected_tokens=15)],
    )
    [image] = forward_backward_images(body)
    assert (image.where, image.data, image.format, image.expected_tokens) == (
        "datum 1: model_input.chunks[1]",
        png,
        "png",
        15,
    )
    assert forward_backward_images(_body([types.EncodedTextChunk(tokens=[1])])) == []
    unset = forward_backward_images(_body([types.ImageChunk(data=png, format="png")]))
    assert unset[0].expected_tokens is None


def test_override_dimensions_is_refused_by_name():
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1)
    chunk = msg.data.add().model_input.add().image
    chunk.data, chunk.format = _png(64, 64), "png"
    chunk.override_dimensions.width = 32
    with pytest.raises(
        ValueError, match=r"datum 0: model_input.chunks\[0\]: image.override_dimensions is not supported"
    ):
        forward_backward_images(msg.SerializeToString())


@pytest.mark.parametrize("op", WHERE)
def test_a_good_image_passes_for_training_and_sampling(op):
    assert _tokens(100, 150) == 15
    good = types.ImageChunk(data=_png(100, 150), format="png", expected_tokens=15)
    assert _problem(good, op=op) == ""


@pytest.mark.parametrize("op", WHERE)
def test_expected_tokens_that_disagree_names_both_counts(op):
    problem = _problem(types.ImageChunk(data=_png(100, 150), format="png", expected_tokens=7), op=op)
    assert problem == f"{WHERE[op]}: expected_tokens=7 but the image becomes 15 tokens"


@pytest.mark.parametrize("op", WHERE)
@pytest.mark.parametrize(
    "data, fmt, needle",
    [
        (_png(100, 150)[: len(_png(100, 150)) // 2], "png", "image data is not a valid png image"),  # truncated
        (b"just some text, saved as cat.png\n" * 10, "png", "image data is not a valid png image"),
        (_png(100, 150), "jpeg", "image data is not a valid jpeg image"),  # a png declared jpeg
    ],
)
def test_bad_bytes_are_named(data, fmt, needle, op):
    problem = _problem(types.ImageChunk(data=data, format=fmt, expected_tokens=15), op=op)
    assert problem.startswith(f"{WHERE[op]}: " + needle), problem


@pytest.mark.parametrize("op", WHERE)
def test_a_40_megapixel_image_is_over_the_pixel_limit(op):
    """Refused from its header: 8,000 x 5,000 of one colour compresses to a small png."""
    big = io.BytesIO()
    Image.new("RGB", (8000, 5000)).save(big, format="PNG")
    problem = _problem(types.ImageChunk(data=big.getvalue(), format="png"), op=op)
    assert problem == f"{WHERE[op]}: image is 8000x5000 pixels, over the limit of {MAX_IMAGE_PIXELS} pixels"


def test_too_many_images_in_one_datum():
    png = _png(64, 64)
    chunks = [types.ImageChunk(data=png, format="png") for _ in range(MAX_IMAGES_PER_DATUM + 1)]
    problem = images_problem(forward_backward_images(_body(chunks)), VL)
    assert problem == (
        f"datum 0 has more than {MAX_IMAGES_PER_DATUM} images, over the limit of {MAX_IMAGES_PER_DATUM} images "
        "per datum"
    )
    spread = [[types.ImageChunk(data=png, format="png")] * MAX_IMAGES_PER_DATUM] * 2  # the limit is per datum
    assert images_problem(forward_backward_images(_body(*spread)), VL) == ""


def test_a_model_without_a_vision_tower_refuses_images_by_name():
    problem = _problem(types.ImageChunk(data=_png(100, 150), format="png"), TEXT)
    assert problem == "base model 'tiny-text' has no vision tower: it takes text chunks only, not images"


def test_prompt_images_and_asset_pointers():
    png = _png(100, 150)
    prompt = types.ModelInput(
        chunks=[types.EncodedTextChunk(tokens=[1]), types.ImageChunk(data=png, format="png", expected_tokens=3)]
    )
    images = prompt_images(list(prompt.chunks))
    assert images_problem(images, VL) == "prompt: chunks[1]: expected_tokens=3 but the image becomes 15 tokens"
    pointer = types.ImageAssetPointerChunk(format="png", location="https://example.com/cat.png")
    with pytest.raises(ValueError, match=r"prompt.chunks\[0\]: image_asset_pointer chunks are not served"):
        prompt_images([pointer])
