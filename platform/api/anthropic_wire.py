"""Anthropic's Messages API on the wire, for routes_anthropic.py: the request bodies of /v1/messages and
/v1/messages/count_tokens as pydantic models, the error body, the `Message` answer and the stream's events.

Only what this server can honour is accepted. Content is text, and images in messages (inline base64 png or jpeg; a
`url` source is refused by name, since this service does not fetch): any other content block type (document,
tool_use, tool_result, thinking, ...) is refused with a 400 naming the type, and so is every parameter these models do
not declare (tools, thinking, service_tier, ...): Anthropic's own API refuses unknown fields too, and accepting one it
would act on (tools, thinking) while doing nothing would give a different answer than the client asked for. Types
are JSON's, strictly: `true` is not a max_tokens and "0.5" is not a temperature.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from tinkerflow.api.image_checks import RawImage
from tinkerflow.api.openai_models import MAX_STOPS
from tinkerflow.api.openai_render import Rendered

# Anthropic's error `type` for each HTTP status it answers with; other 4xx are the request's fault, other 5xx ours.
ERROR_TYPES: Mapping[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}
# Anthropic bounds metadata.user_id at 256 characters.
MAX_USER_ID = 256


class AnthropicError(Exception):
    """An error answered in Anthropic's body shape: {"type": "error", "error": {"type", "message"}}."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s

    @property
    def kind(self) -> str:
        return ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")

    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.kind, "message": self.message}}


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str
    # A prompt-caching hint (Claude clients mark their system prompt with it): caching changes what a call costs,
    # never its answer, and the engine's prefix cache reuses a shared prompt prefix anyway. Accepted so those clients
    # work unchanged; nothing reads it.
    cache_control: CacheControl | None = None


# An image block's media type -> ImageChunk.format
IMAGE_MEDIA_TYPES = {"image/png": "png", "image/jpeg": "jpeg"}
SEND_BASE64 = 'send the image inline: {"type": "base64", "media_type": "image/png" or "image/jpeg", "data": ...}'


class ImageSource(BaseModel):
    """An image sent inline: base64 bytes of a png or jpeg (a `url` or `file` source is refused by name before)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["base64"]
    media_type: str
    data: str

    @field_validator("media_type")
    @classmethod
    def _media(cls, v: str) -> str:
        if v not in IMAGE_MEDIA_TYPES:
            raise ValueError(f"media_type {v!r} is not served; images must be one of {', '.join(IMAGE_MEDIA_TYPES)}")
        return v

    @field_validator("data")
    @classmethod
    def _base64(cls, v: str) -> str:
        try:
            base64.b64decode(v, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"data is not valid base64 ({e})") from None
        return v


class ImageBlock(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["image"]
    source: ImageSource
    cache_control: CacheControl | None = None  # as TextBlock.cache_control


def _as_blocks(v: Any, *, images: bool = False) -> Any:
    """Content as a list of blocks: a string is one text block; a block of a type not taken here is refused by name
    (before pydantic would report it as a mismatch against the text block's fields), and so is an image whose source
    is not inline bytes, since this service does not fetch."""
    if isinstance(v, str):
        return [{"type": "text", "text": v}]
    if not isinstance(v, list):
        raise ValueError("content must be a string or a list of content blocks")
    taken = ("text", "image") if images else ("text",)
    for block in v:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in taken:
            named = f"of type {kind!r}" if isinstance(kind, str) else "without a string `type`"
            raise ValueError(
                f"content blocks {named} are not supported: this server accepts {' and '.join(taken)} blocks only"
            )
        source = block.get("source") if kind == "image" else None
        where = source.get("type") if isinstance(source, dict) else None
        if kind == "image" and where != "base64":
            said = f"a {where!r} source is not served: this service does not fetch images" if where else "no source"
            raise ValueError(f"an image block with {said}; {SEND_BASE64}")
    return v


TextContent = Annotated[list[TextBlock], BeforeValidator(_as_blocks)]
# A message's content: text, and images (each an inline png or jpeg).
MessageContent = Annotated[
    list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]],
    BeforeValidator(lambda v: _as_blocks(v, images=True)),
]
# `system` may be absent or null: no blocks (a plain list, so an error's path names no union member).
SystemContent = Annotated[list[TextBlock], BeforeValidator(lambda v: [] if v is None else _as_blocks(v))]


def text_of(blocks: list[TextBlock] | list[TextBlock | ImageBlock]) -> str:
    """The text blocks' text joined as it is (no separator, as the OpenAI endpoint joins text parts)."""
    return "".join(b.text for b in blocks if isinstance(b, TextBlock))


def template_content(blocks: list[TextBlock | ImageBlock]) -> str | list[dict[str, Any]]:
    """A message's content as a chat template reads it: its text, or with images a list of text items and
    `{"type": "image"}` items in order, which a vision model's template renders as its image tokens (chat_images.py)."""
    if not any(isinstance(b, ImageBlock) for b in blocks):
        return text_of(blocks)
    return [{"type": "text", "text": b.text} if isinstance(b, TextBlock) else {"type": "image"} for b in blocks]


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["user", "assistant"]
    content: MessageContent

    def content_given(self) -> bool:
        return bool(text_of(self.content)) or any(isinstance(b, ImageBlock) for b in self.content)


class Metadata(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # Anthropic reads user_id to attribute abuse to an end user; this server has no such policing and the value
    # changes no answer, so it is bounded like Anthropic's and then deliberately not used. Other keys are refused.
    user_id: str | None = Field(default=None, max_length=MAX_USER_ID)


class PromptRequest(BaseModel):
    """What both routes render into a prompt: the body of /v1/messages/count_tokens."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: SystemContent = Field(default_factory=list)
    cache_control: CacheControl | None = None  # top-level prompt caching: see TextBlock.cache_control

    @model_validator(mode="after")
    def _non_empty(self) -> PromptRequest:
        last = len(self.messages) - 1
        for i, m in enumerate(self.messages):
            # Anthropic's own rule: an empty final assistant turn asks for a fresh answer; an empty turn elsewhere
            # would render as a turn with nothing said, which no chat template expects.
            if not m.content_given() and not (i == last and m.role == "assistant"):
                raise ValueError(
                    f"messages.{i}: all messages must have non-empty content except for the optional final "
                    "assistant message"
                )
        return self

    def turns(self) -> list[dict[str, Any]]:
        """The conversation as a chat template reads it: the system prompt first when there is one."""
        system = text_of(self.system)
        out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        return out + [{"role": m.role, "content": template_content(m.content)} for m in self.messages]

    def images(self) -> list[RawImage]:
        """The messages' image blocks in order (each checked as an ImageChunk is, image_checks.py); one prompt, so
        they count toward one datum's image limit."""
        return [
            RawImage(
                f"prompt: messages.{i}.content.{j}",
                base64.b64decode(b.source.data),
                IMAGE_MEDIA_TYPES[b.source.media_type],
                None,
            )
            for i, m in enumerate(self.messages)
            for j, b in enumerate(m.content)
            if isinstance(b, ImageBlock)
        ]


@dataclass(frozen=True)
class Knobs:
    """A Messages request's sampling parameters as the shared submission reads them (endpoint_sampling.Knobs)."""

    temperature: float
    top_p: float
    top_k: int
    stop: list[str] | None
    n: int = 1  # one answer per request: the Messages API has no `n`
    seed: int | None = None  # the Messages API has no seed; temperature 0 is greedy, hence repeatable


class MessagesRequest(PromptRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOPS)
    # Anthropic's range is 0..1 (not OpenAI's 0..2); its default is 1.
    temperature: float = Field(default=1.0, ge=0.0, le=1.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=1)
    stream: bool = False
    metadata: Metadata | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and any(not s for s in v):
            raise ValueError("stop sequences must be non-empty strings")
        return v or None

    def knobs(self) -> Knobs:
        return Knobs(
            temperature=self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,  # -1: no top-k cut, the engine's "off"
            stop=self.stop_sequences,
        )


def first_error(e: ValidationError, accepted: list[str]) -> AnthropicError:
    """A 400 naming the first bad field by its path (`messages.0.content`, `temperature`), as Anthropic's do."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    if err.get("type") == "extra_forbidden":
        if "." in where:
            msg = "this field is not supported here"
        else:
            msg = f"this parameter is not supported by this server (it accepts {', '.join(accepted)})"
    return AnthropicError(400, f"{where}: {msg}" if where else msg)


def stop_reason(r: Rendered) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of one rendered answer: a stop sequence the text was cut at, else the engine's
    reason: "stop" is the model's end-of-sequence token (end_turn), "length" is max_tokens."""
    if r.stop_sequence is not None:
        return "stop_sequence", r.stop_sequence
    return ("end_turn", None) if r.finish_reason == "stop" else ("max_tokens", None)


def message_shell(message_id: str, model: str, input_tokens: int) -> dict[str, Any]:
    """The Message before its content: what a stream's message_start carries."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }


def message(message_id: str, model: str, input_tokens: int, r: Rendered) -> dict[str, Any]:
    """The whole Message: one text block (empty when the model ended its turn at once), why it stopped, usage."""
    reason, sequence = stop_reason(r)
    return {
        **message_shell(message_id, model, input_tokens),
        "content": [{"type": "text", "text": r.text}],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": input_tokens, "output_tokens": r.completion_tokens},
    }


def event(name: str, data: dict[str, Any]) -> str:
    """One server-sent event with its `event:` line: Anthropic's clients dispatch on it (and skip unnamed ones)."""
    return f"event: {name}\ndata: {json.dumps({'type': name, **data}, separators=(',', ':'))}\n\n"


def answer_events(r: Rendered) -> list[str]:
    """A Message's stream after message_start: its one text block (a delta per token piece), then why it stopped."""
    reason, sequence = stop_reason(r)
    block = 0
    out = [event("content_block_start", {"index": block, "content_block": {"type": "text", "text": ""}})]
    out += [
        event("content_block_delta", {"index": block, "delta": {"type": "text_delta", "text": piece}})
        for piece in r.pieces
        if piece
    ]
    out.append(event("content_block_stop", {"index": block}))
    out.append(
        event(
            "message_delta",
            {
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": {"output_tokens": r.completion_tokens},
            },
        )
    )
    out.append(event("message_stop", {}))
    return out
