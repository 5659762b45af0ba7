"""A model input's chunks as the engine takes them: token ids, where each `ImageChunk` (for a model with a vision
tower: `ImageRules`) becomes its image's placeholder tokens (as many as its `expected_tokens`) and its patch rows,
cut by the served checkpoint's own image processor (tinkerflow.common.images), the one the API checked it with.

One converter for every op that carries a ModelInput: a forward_backward datum (the SDK's protobuf chunks) and a
sample request's prompt (its JSON chunks) both become `Part`s here, so training and sampling place an image's
tokens the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as pb
from tinker.types import EncodedTextChunk, ImageChunk

from tinkerflow.common.images import (
    MAX_IMAGES_PER_DATUM,
    ImageProcessing,
    ProcessedImage,
    check_expected_tokens,
    decode_image,
    preprocess,
)
from tinkerflow.workers.engine.types import InputError


@dataclass(frozen=True)
class ImageRules:
    """How the served model takes images: its image processor, and the token an image's features replace."""

    processing: ImageProcessing
    token_id: int


def image_rules(image_processor: dict[str, Any] | None, image_token_id: int | None) -> ImageRules | None:
    """The rules of a model whose engine runs a vision tower (ModelCard.image_processor, ModelInfo.image_token_id);
    None for a text model, or a processor this server does not follow (the API refuses its images by name)."""
    if image_processor is None or image_token_id is None:
        return None
    try:
        return ImageRules(ImageProcessing.from_hf(image_processor), image_token_id)
    except ValueError:
        return None


@dataclass(frozen=True)
class WireImage:
    """An image chunk as it arrived: its bytes, declared format, optional expected_tokens."""

    data: bytes
    format: str
    expected_tokens: int | None
    override_dimensions: bool = False  # the SDK never sets it; honouring it would resize


# A run of token ids, an image, or the kind name of a chunk the engine does not take.
Part = np.ndarray | WireImage | str


def model_tokens(
    parts: Sequence[Part], where: str, rules: ImageRules | None
) -> tuple[np.ndarray, tuple[ProcessedImage, ...]]:
    """The input's int32 token ids (an image: its placeholder tokens) and its images, in order. `where` names the
    input in errors (e.g. "datum 0: model_input", "prompt"); each chunk is `{where}.chunks[j]`."""
    tokens: list[np.ndarray] = []
    images: list[ProcessedImage] = []
    for j, part in enumerate(parts):
        at = f"{where}.chunks[{j}]"
        if isinstance(part, WireImage) and rules is not None:
            if len(images) == MAX_IMAGES_PER_DATUM:
                raise InputError(f"{where}: more than {MAX_IMAGES_PER_DATUM} images, the limit per datum")
            images.append(_image(part, at, rules))
            tokens.append(np.full(images[-1].tokens, rules.token_id, np.int32))
        elif isinstance(part, np.ndarray):
            tokens.append(part.astype(np.int32, copy=False))
        else:
            kind = "image" if isinstance(part, WireImage) else part
            raise InputError(f"{at}: {kind} chunks are not supported by this text-only model")
    return (np.concatenate(tokens) if tokens else np.zeros((0,), np.int32)), tuple(images)


def _image(image: WireImage, where: str, rules: ImageRules) -> ProcessedImage:
    if image.override_dimensions:
        raise InputError(f"{where}: image.override_dimensions is not supported; send the image at its size")
    try:
        processed = preprocess(decode_image(image.data, image.format), rules.processing)
        check_expected_tokens(image.expected_tokens, processed.tokens)
    except InputError as e:
        raise InputError(f"{where}: {e}") from e
    return processed


def proto_parts(chunks: Iterable[pb.Chunk], where: str) -> list[Part]:
    """A forward_backward datum's protobuf chunks as Parts."""
    parts: list[Part] = []
    for j, chunk in enumerate(chunks):
        which = chunk.WhichOneof("chunk")
        if which == "image":
            c = chunk.image
            expected = c.expected_tokens if c.HasField("expected_tokens") else None
            parts.append(WireImage(c.data, c.format, expected, c.HasField("override_dimensions")))
        elif which == "encoded_text":
            if len(chunk.encoded_text.tokens) % 4:
                raise InputError(f"{where}.chunks[{j}]: encoded_text tokens are not a whole number of int32 values")
            parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        else:
            parts.append(str(which))
    return parts


def json_parts(chunks: Iterable[Any]) -> list[Part]:
    """A sample request's prompt chunks (the SDK's pydantic models) as Parts."""
    parts: list[Part] = []
    for chunk in chunks:
        if isinstance(chunk, EncodedTextChunk):
            parts.append(np.asarray(chunk.tokens, dtype=np.int32))
        elif isinstance(chunk, ImageChunk):
            parts.append(WireImage(chunk.data, chunk.format, chunk.expected_tokens))
        else:
            parts.append(str(getattr(chunk, "type", type(chunk).__name__)))
    return parts
