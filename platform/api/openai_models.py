"""OpenAI's request bodies for /v1/completions and /v1/chat/completions, as pydantic models, and its error body.

Only what this server can honour is accepted: a parameter it cannot honour with a value that would change the answer
(penalties, logit_bias, tools, best_of, top alternatives of generated tokens) is refused with a 400 naming it,
never silently
ignored. Fields that change nothing here (`user`, `metadata`, `store`, `service_tier`, ...) are ignored, as OpenAI's
own server ignores what it does not use.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# OpenAI caps logprobs at 5 for completions and top_logprobs at 20 for chat.
MAX_COMPLETION_LOGPROBS = 5
# OpenAI allows 4 stop sequences; a few more cost nothing and help chat renderers with several end markers.
MAX_STOPS = 16


class OpenAIError(Exception):
    """An error answered in OpenAI's body shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,  # a 429's Retry-After, when it is not the queue's second
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        kind = {
            400: "invalid_request_error",
            401: "authentication_error",
            403: "permission_error",
            404: "invalid_request_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
        }
        return {
            "error": {
                "message": self.message,
                "type": kind.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    """The sampling parameters both endpoints share, with OpenAI's defaults and ranges."""

    model_config = ConfigDict(extra="ignore", strict=False)
    model: str = Field(min_length=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)  # vLLM's extension; -1 = off
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is not None:
            if len(stops) > MAX_STOPS:
                raise ValueError(f"at most {MAX_STOPS} stop sequences")
            if any(not s for s in stops):
                raise ValueError("stop sequences must be non-empty strings")
        return stops or None

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and not -(2**63) <= v < 2**64:
            raise ValueError("seed must fit in 64 bits")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        """(param, why) for a parameter set to a value this server cannot honour."""
        if self.frequency_penalty:
            return "frequency_penalty", "frequency_penalty is not supported (use 0)"
        if self.presence_penalty:
            return "presence_penalty", "presence_penalty is not supported (use 0)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)  # OpenAI's default for completions; 0 only with echo
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """One or several prompts: a string, a list of token ids, or a batch of either."""
        p = self.prompt
        if isinstance(p, str) or (p and all(isinstance(t, int) for t in p)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo and self.stream:
            return "echo", "echo is not supported with stream"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens must be at least 1 (0 only with echo, to score the prompt)"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is not supported (leave it unset)"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if self.logprobs and not self.echo:
            # The engine reports the sampled token's logprob, not the k most likely alternatives; it does compute
            # the top-k alternatives at each prompt position, which echo returns.
            return "logprobs", (
                "logprobs > 0 (top alternatives) is supported only with echo, for the prompt's "
                "tokens; logprobs=0 returns each sampled token's logprob"
            )
        return super().unsupported()


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None

    def as_template_input(self) -> dict[str, Any]:
        """What a chat template reads: role and content. Text parts are joined into one string; with an image_url
        part the content stays a list of text items and `{"type": "image"}` items, in order, which a vision model's
        template renders as its image tokens (chat_images.py); other parts are refused."""
        content = self.content
        if isinstance(content, list):
            items: list[dict[str, Any]] = []
            for part in content:
                if part.get("type") == "image_url":
                    items.append({"type": "image"})
                elif part.get("type") == "text" and isinstance(part.get("text"), str):
                    items.append({"type": "text", "text": part["text"]})
                else:
                    raise ValueError(f"content parts of type {part.get('type')!r} are not supported (text, image_url)")
            images = any(item["type"] == "image" for item in items)
            content = items if images else "".join(item["text"] for item in items)
        out = {k: v for k, v in (self.model_extra or {}).items() if k in ("name",)}
        return {"role": self.role, "content": content or "", **out}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs:
            return "top_logprobs", (
                "top_logprobs > 0 is not supported: the engine reports each sampled token's "
                "logprob only (use logprobs=true with top_logprobs 0 or unset)"
            )
        if self.tools:
            return "tools", "tools (function calling) are not supported"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format", 'only response_format {"type": "text"} is supported'
        return super().unsupported()


def first_error(e: ValidationError) -> OpenAIError:
    """A 400 naming the first bad parameter, as OpenAI names it (`messages`, `temperature`, ...)."""
    err = e.errors()[0]
    loc = [str(p) for p in err.get("loc", ())]
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    msg = str(err.get("msg", "invalid"))
    if err.get("type") == "missing":
        return OpenAIError(400, f"missing required parameter: '{where}'", param, "missing_required_parameter")
    return OpenAIError(400, f"invalid value for '{where}': {msg}", param, "invalid_value")


FinishReason = Literal["stop", "length"]
