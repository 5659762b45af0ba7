"""A chat's images in its sample prompt, for the OpenAI- and Anthropic-compatible endpoints.

The model's own chat template places each image: an image content item reaches it as `{"type": "image"}`, which
Qwen3.5's template renders as `<|vision_start|><|image_pad|><|vision_end|>`. Its processor then widens each image
token (the one the checkpoint's config.json names `image_token_id`) to as many as the image makes. Here the rendered
text is cut at each image token instead: text chunks around one ImageChunk per image, whose placeholder tokens the
worker puts in that place, as many as the same image processor makes (activities/wire_images.py). So the prompt is
token for token what transformers' processor builds, and what the SDK's prompts with images train and sample on.
"""

from __future__ import annotations

import base64
import functools
import json
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tinkerflow.api.image_checks import RawImage
from tinkerflow.api.openai_models import OpenAIError
from tinkerflow.workflows.protocol.messages import ModelCard

IMAGE_ITEM = {"type": "image"}  # an image content item as a chat template reads it (the bytes travel apart)


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat as sample-request prompt chunks (the SDK's JSON ModelInput), and its length in tokens with
    each image's placeholder tokens counted."""

    chunks: list[dict[str, Any]]
    length: int

    def __len__(self) -> int:
        return self.length

    @staticmethod
    def of_tokens(tokens: list[int]) -> ChatPrompt:
        return ChatPrompt([{"type": "encoded_text", "tokens": tokens}], len(tokens))


@functools.lru_cache(maxsize=16)
def image_token_id(local_path: str) -> int | None:
    """The token a served checkpoint's images stand in for (its config.json's `image_token_id`)."""
    try:
        config = json.loads((pathlib.Path(local_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    found = config.get("image_token_id")
    return found if isinstance(found, int) else None


def chat_prompt(
    tokenizer: Any, text: str, images: Sequence[RawImage], tokens: Sequence[int], card: ModelCard
) -> ChatPrompt:
    """The rendered chat `text` as prompt chunks: text tokens, and each image (`tokens[i]` placeholder tokens, as the
    API counted them) where the template put its image token; a 400 when the template placed another number."""
    if not images:
        return ChatPrompt.of_tokens(list(tokenizer.encode(text, add_special_tokens=False)))
    token_id = image_token_id(card.local_path)
    marker = tokenizer.convert_ids_to_tokens(token_id) if token_id is not None else None
    pieces = text.split(marker) if isinstance(marker, str) and marker else [text]
    if len(pieces) - 1 != len(images):
        raise OpenAIError(
            400,
            f"the chat template of {card.name} placed {len(pieces) - 1} image tokens for the {len(images)} images in "
            "these messages, so the images cannot be put in the prompt",
            "messages",
            "invalid_image",
        )
    chunks: list[dict[str, Any]] = []
    length = 0
    for i, piece in enumerate(pieces):
        ids = list(tokenizer.encode(piece, add_special_tokens=False)) if piece else []
        if ids:
            chunks.append({"type": "encoded_text", "tokens": ids})
            length += len(ids)
        if i < len(images):
            image = images[i]
            data = base64.b64encode(image.data).decode()
            chunks.append({"type": "image", "data": data, "format": image.format, "expected_tokens": tokens[i]})
            length += tokens[i]
    return ChatPrompt(chunks, length)
