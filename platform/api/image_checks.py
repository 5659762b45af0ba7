"""ImageChunks checked where the API first sees them, against the served model's own image processor
(tinkerflow.common.images), so a bad image fails as the sender's error before any worker holds it.

Each image is decoded whole: a truncated png, a text file named .png, an image over the pixel or byte limit, or an
`expected_tokens` that disagrees with the tokens the model's processor makes of it is a problem naming the datum,
the chunk and the field or limit. A model without a vision tower refuses every image by name;
`image_asset_pointer` chunks are refused by name (this service does not fetch). A good image goes on to the worker
(activities/wire_images.py), which trains on it (forward_backward, forward) or samples from it (a prompt's images go
through the served model's vision tower either way).

The routes turn a problem into their contract's user error: a `reject` op for in-sequence training ops
(op_checks.py), a 400 for sampling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from tinkerflow.api.lookups import run_of_caller
from tinkerflow.api.protobuf_header import DATA, MODEL_INPUT, walk_fields
from tinkerflow.api.services import Services
from tinkerflow.common.errors import InputError
from tinkerflow.common.images import MAX_IMAGES_PER_DATUM, ImageProcessing, image_chunk_tokens
from tinkerflow.workflows.protocol.messages import ModelCard

IMAGE = 2  # tinker_public.Chunk.image


@dataclass(frozen=True)
class RawImage:
    """One image chunk as the wire carries it: where it sits, its bytes, format and optional expected_tokens."""

    where: str  # e.g. "datum 0: model_input.chunks[2]"
    data: bytes
    format: str
    expected_tokens: int | None


def model_processing(card: ModelCard) -> ImageProcessing:
    """The served model's image rules; InputError naming the model when it has no vision tower."""
    if card.image_processor is None:
        raise InputError(f"base model {card.name!r} has no vision tower: it takes text chunks only, not images")
    try:
        return ImageProcessing.from_hf(card.image_processor)
    except ValueError as e:  # the checkpoint's processor config, not the sender's image
        raise InputError(f"base model {card.name!r}: its image processor is not one this server follows ({e})") from e


def images_problem(images: list[RawImage], card: ModelCard) -> str:
    """What is wrong with a request's images ("" when there are none or all are good)."""
    try:
        image_tokens(images, card)
    except InputError as e:
        return str(e)
    return ""


def image_tokens(images: list[RawImage], card: ModelCard) -> list[int]:
    """The placeholder tokens each image becomes on the served model; InputError naming what is wrong."""
    if not images:
        return []
    processing = model_processing(card)
    counts: dict[str, int] = {}
    tokens: list[int] = []
    for image in images:
        datum = image.where.split(":", 1)[0]
        counts[datum] = counts.get(datum, 0) + 1
        if counts[datum] > MAX_IMAGES_PER_DATUM:
            raise InputError(
                f"{datum} has more than {MAX_IMAGES_PER_DATUM} images, over the limit of {MAX_IMAGES_PER_DATUM} "
                "images per datum"
            )
        try:
            tokens.append(image_chunk_tokens(image.data, image.format, image.expected_tokens, processing))
        except InputError as e:
            raise InputError(f"{image.where}: {e}") from e
    return tokens


async def forward_backward_problem(svc: Services, model_id: str, body: bytes, who: str) -> str:
    """What is wrong with a forward_backward body's images ("" when it has none: no lookup then)."""
    try:
        images = forward_backward_images(body)
    except InputError as e:
        return str(e)
    if not images:
        return ""
    base_model = (await run_of_caller(svc, model_id, who)).start.base_model
    card = await svc.registry.get(base_model)
    if card is None:
        return f"base model {base_model!r} is not served right now, so its images cannot be checked; retry later"
    return await checked_off_loop(images, card)


async def checked_off_loop(images: list[RawImage], card: ModelCard) -> str:
    """`images_problem` in a thread: decoding a large image takes the CPU for a while, not the API's event loop."""
    return await asyncio.to_thread(images_problem, images, card)


async def counted_off_loop(images: list[RawImage], card: ModelCard) -> list[int]:
    """`image_tokens` in a thread, as `checked_off_loop`."""
    return await asyncio.to_thread(image_tokens, images, card)


def forward_backward_images(body: bytes) -> list[RawImage]:
    """The image chunks of a ForwardBackwardRequest body, walked off the wire (the datums are decoded whole only
    by the worker); an image chunk that does not parse is kept as bytes that fail the decode."""
    images: list[RawImage] = []
    for i, (datum_start, datum_end) in enumerate(_fields(body, 0, len(body), DATA)):
        for j, (chunk_start, chunk_end) in enumerate(_fields(body, datum_start, datum_end, MODEL_INPUT)):
            for start, end in _fields(body, chunk_start, chunk_end, IMAGE):
                where = f"datum {i}: model_input.chunks[{j}]"
                try:
                    chunk = pb.ImageChunk.FromString(body[start:end])
                except DecodeError as e:
                    raise InputError(f"{where}: the image chunk is not a valid ImageChunk protobuf ({e})") from e
                if chunk.HasField("override_dimensions"):  # the SDK never sets it; honouring it would resize
                    raise InputError(f"{where}: image.override_dimensions is not supported; send the image at its size")
                expected = chunk.expected_tokens if chunk.HasField("expected_tokens") else None
                images.append(RawImage(where, chunk.data, chunk.format, expected))
    return images


def _fields(body: bytes, start: int, end: int, number: int) -> Iterator[tuple[int, int]]:
    for field, s, e in walk_fields(body, start, end):
        if field == number:
            yield s, e


def prompt_images(chunks: list[Any], field: str = "prompt") -> list[RawImage]:
    """The images of a JSON ModelInput's chunks (the SDK's pydantic models); InputError for an
    `image_asset_pointer` chunk, which this service does not fetch."""
    images: list[RawImage] = []
    for j, chunk in enumerate(chunks):
        kind = getattr(chunk, "type", "")
        if kind == "image_asset_pointer":
            raise InputError(
                f"{field}.chunks[{j}]: image_asset_pointer chunks are not served (this service does not fetch "
                "images by location): send the image's bytes in an ImageChunk"
            )
        if kind == "image":
            images.append(RawImage(f"{field}: chunks[{j}]", chunk.data, chunk.format, chunk.expected_tokens))
    return images
