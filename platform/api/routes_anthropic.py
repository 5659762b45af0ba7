"""Anthropic-compatible POST /v1/messages and /v1/messages/count_tokens, beside the OpenAI-compatible routes, for
Claude-style clients: `anthropic.Anthropic(base_url="http://HOST:PORT", api_key=<a tinkerflow key>)`.

The same machinery as routes_openai (endpoint_sampling): `model` is a served base model or a `tinker://` path of
saved weights the caller may read; requests take the Tinker sampling path (caps, queue limit with 429 + Retry-After,
batched with SDK calls) on a sampler of the tenant's one `openai-<owner>` session, which both endpoints share. The
conversation is rendered with the model's chat template, the system prompt as a leading system turn; a conversation
that ends with an assistant turn is continued from it (Anthropic's prefill). The key is `x-api-key` (Anthropic's
header) or `Authorization: Bearer` (what the OpenAI endpoint takes, and what the anthropic SDK sends). Every error is
in Anthropic's shape (anthropic_wire). Streaming sends message_start at once, `ping` events while the engine works
(it returns whole sequences, not tokens), then the text block's deltas, one per token, and message_stop.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError

from tinkerflow.api.anthropic_wire import (
    AnthropicError,
    MessagesRequest,
    PromptRequest,
    answer_events,
    event,
    first_error,
    message,
    message_shell,
)
from tinkerflow.api.caller import metrics_caller, services
from tinkerflow.api.chat_images import ChatPrompt, chat_prompt
from tinkerflow.api.endpoint_sampling import (
    RETRY_AFTER_S,
    Target,
    check_request_caps,
    resolve_target,
    results,
    samplers_of,
    submit,
    token_budget,
)
from tinkerflow.api.image_checks import counted_off_loop
from tinkerflow.api.lookups import json_body
from tinkerflow.api.openai_models import OpenAIError
from tinkerflow.api.openai_render import Rendered, render
from tinkerflow.api.services import Services
from tinkerflow.common.errors import InputError, TinkerflowError

log = logging.getLogger(__name__)
# A `ping` event this often while the engine works (a first compile can take minutes): proxies that cut idle
# connections keep the stream, and Anthropic's clients skip pings.
KEEPALIVE_S = 15.0


def _error_response(e: AnthropicError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s or RETRY_AFTER_S)} if e.status == 429 else None
    return JSONResponse(status_code=e.status, content=e.body(), headers=headers)


def as_anthropic(e: Exception) -> AnthropicError:
    """Any error these routes meet, as Anthropic's: the shared sampling steps raise OpenAIError, lookups and the key
    check HTTPException, the taxonomy TinkerflowError; each keeps its status and message."""
    if isinstance(e, AnthropicError):
        return e
    if isinstance(e, OpenAIError):
        return AnthropicError(e.status, e.message, e.retry_after_s)
    if isinstance(e, HTTPException):
        return AnthropicError(e.status_code, str(e.detail))
    if isinstance(e, TinkerflowError):
        return AnthropicError(e.http_status, str(e))
    if isinstance(e, (RequestValidationError, ValidationError)):
        return AnthropicError(400, f"invalid request: {e}")
    return AnthropicError(500, "internal server error; the API's log has the details")


class AnthropicRoute(APIRoute):
    """Every error of these routes (auth, validation, lookups, the engine) in Anthropic's body shape, which its
    clients turn into typed exceptions (BadRequestError, NotFoundError, ...)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            # Read (and cache) the body outside the catch-all below: a body over the route's limit raises through
            # here to BodyLimit, which answers it 413; caught, it would read as a failure of ours.
            await request.body()
            try:
                return await handler(request)
            except Exception as e:
                err = as_anthropic(e)
                if err.status >= 500:
                    log.exception("anthropic route %s failed", request.url.path)
                return _error_response(err)

        return route


router = APIRouter(prefix="/v1", route_class=AnthropicRoute)


def _parse(model: type[PromptRequest], raw: dict[str, Any]) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise first_error(e, list(model.model_fields)) from None


async def _prompt(request: Request, svc: Services, who: str, req: PromptRequest) -> tuple[Target, Any, ChatPrompt]:
    """The target, its tokenizer, and the conversation rendered with its chat template as a prompt (its images
    where the template puts them, chat_images.py)."""
    target = await resolve_target(svc, req.model, who)
    images = req.images()
    try:
        image_tokens = await counted_off_loop(images, target.card) if images else []
    except InputError as e:
        raise AnthropicError(400, f"messages: {e}") from None
    tokenizer = await samplers_of(request).tokenizer(target.card.name, target.card.local_path)
    if not getattr(tokenizer, "chat_template", None):
        raise AnthropicError(
            400,
            f"model: the tokenizer of {target.card.name} has no chat template, which the Messages API needs; use "
            "/v1/completions with a prompt you format yourself",
        )
    turns = req.turns()
    prefill = turns[-1]["role"] == "assistant"
    if prefill and not turns[-1]["content"]:
        turns.pop()  # an empty final assistant turn asks for a fresh answer, as with no such turn
        prefill = False
    if not any(t["role"] != "system" for t in turns):
        raise AnthropicError(400, "messages: the conversation has no turn with content")
    try:
        # A final assistant turn is continued, not closed: the answer picks up where it stops.
        text = tokenizer.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=not prefill, continue_final_message=prefill
        )
    except Exception as e:  # the template itself raises on conversations it does not accept (roles, order)
        raise AnthropicError(400, f"messages: the chat template of {target.card.name} refused them: {e}") from None
    return target, tokenizer, chat_prompt(tokenizer, text, images, image_tokens, target.card)


@router.post("/messages/count_tokens")
async def count_tokens(
    request: Request, svc: Services = Depends(services), who: str = Depends(metrics_caller)
) -> dict[str, int]:
    req: PromptRequest = _parse(PromptRequest, await json_body(request))
    _, _, prompt = await _prompt(request, svc, who, req)
    return {"input_tokens": len(prompt)}


@router.post("/messages", response_model=None)
async def messages(
    request: Request, svc: Services = Depends(services), who: str = Depends(metrics_caller)
) -> dict | Response:
    req: MessagesRequest = _parse(MessagesRequest, await json_body(request))
    check_request_caps(svc, 1, req.max_tokens, "max_tokens")
    target, tokenizer, prompt = await _prompt(request, svc, who, req)
    knobs = req.knobs()
    budget = token_budget(svc, target.card, prompt, req.max_tokens, "max_tokens")
    ref = await submit(svc, samplers_of(request), who, target, prompt, knobs, budget)

    async def answer() -> Rendered:
        response = await results(svc, ref)
        s = response.sequences[0]
        return render(tokenizer, s.tokens, s.logprobs, s.stop_reason, knobs.stop)

    message_id = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        return _stream(message_shell(message_id, req.model, len(prompt)), answer())
    return message(message_id, req.model, len(prompt), await answer())


def _stream(start: dict[str, Any], pending: Coroutine[Any, Any, Rendered]) -> StreamingResponse:
    """Anthropic's server-sent events: message_start, pings until the engine answers, the answer's events; an
    `error` event (Anthropic's shape, which its clients raise) if sampling fails after the stream has begun."""

    async def events() -> AsyncIterator[str]:
        yield event("message_start", {"message": start})
        task = asyncio.ensure_future(pending)
        try:
            while not (await asyncio.wait({task}, timeout=KEEPALIVE_S))[0]:
                yield event("ping", {})
            rendered = task.result()
        except Exception as e:
            err = as_anthropic(e)
            if err.status >= 500:
                log.exception("anthropic stream failed")
            yield event("error", {"error": err.body()["error"]})
            return
        finally:
            task.cancel()  # the client went away: stop waiting (the sampled result is simply not read)
        for part in answer_events(rendered):
            yield part

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
