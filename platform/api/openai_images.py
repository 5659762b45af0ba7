"""OpenAI chat messages' `image_url` content parts, read into the same image checks an SDK ImageChunk goes through
(image_checks.py).

Only data: URLs are taken (`data:image/png;base64,...`, `data:image/jpeg;base64,...`): the service does not fetch,
so an http(s) URL is refused by name with what to send instead. Every refusal is a 400 naming the part
(`messages[i].content[j].image_url`).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any

from tinkerflow.api.image_checks import RawImage
from tinkerflow.api.openai_models import OpenAIError

# A data URL's media type -> ImageChunk.format
MEDIA_TYPES = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg"}
SEND_DATA_URL = "send the image inline as a data: URL (data:image/png;base64,... or data:image/jpeg;base64,...)"


def data_url_image(url: Any, where: str) -> tuple[bytes, str]:
    """(bytes, format) of a base64 data: URL; 400 naming `where` for anything else."""
    if not isinstance(url, str) or not url:
        raise OpenAIError(400, f"{where}.url must be a non-empty string; {SEND_DATA_URL}", where, "invalid_value")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise OpenAIError(
            400,
            f"{where}.url is a remote {scheme} URL: this service does not fetch images; {SEND_DATA_URL}",
            where,
            "invalid_image_url",
        )
    if scheme != "data":
        raise OpenAIError(400, f"{where}.url is not a data: URL; {SEND_DATA_URL}", where, "invalid_image_url")
    header, sep, payload = url[len("data:") :].partition(",")
    media, *params = header.split(";")
    if not sep or "base64" not in params:
        raise OpenAIError(400, f"{where}.url must be a base64 data: URL; {SEND_DATA_URL}", where, "invalid_image_url")
    fmt = MEDIA_TYPES.get(media.strip().lower())
    if fmt is None:
        raise OpenAIError(
            400,
            f"{where}.url has media type {media!r}; images must be one of {', '.join(sorted(MEDIA_TYPES))}",
            where,
            "invalid_image_url",
        )
    try:
        return base64.b64decode(payload, validate=True), fmt
    except (binascii.Error, ValueError) as e:
        raise OpenAIError(400, f"{where}.url is not valid base64 ({e})", where, "invalid_image_url") from None


def message_images(messages: Sequence[Any]) -> list[RawImage]:
    """The images of chat messages' `image_url` parts (ChatMessage's content lists), in order; every image counts
    toward one datum's limit (a chat is one prompt)."""
    images: list[RawImage] = []
    for i, message in enumerate(messages):
        content = message.content
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "image_url":
                continue
            where = f"messages[{i}].content[{j}].image_url"
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            data, fmt = data_url_image(url, where)
            images.append(RawImage(f"prompt: {where}", data, fmt, None))
    return images
