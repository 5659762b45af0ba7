"""OpenAI-compatible /v1/completions, /v1/chat/completions and /v1/models, for evaluation tools and plain `openai`
clients: `openai.OpenAI(base_url="http://HOST:PORT/v1", api_key=<a tinkerflow key>)`.

`model` is a served base model's name or a `tinker://` path of saved weights the caller may read (the same check and
the same 404 for another tenant's private checkpoint as create_sampling_session). Requests go through the Tinker
sampling path: the same caps, the same queue limit (429 + Retry-After), the same claim-check store and SampleBatcher
(so they share decode batches with SDK calls), on a sampler of the tenant's one OpenAI session (openai_samplers).
Errors use OpenAI's body shape. Streaming sends OpenAI's chunks after the engine has returned the whole sequences
(the engine does not stream tokens), one chunk per token, then `data: [DONE]`. The steps the Anthropic-compatible
routes share with these (resolve `model`, caps, submit, wait) are endpoint_sampling's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, cast

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError

from tinkerflow.api.caller import metrics_caller, services
from tinkerflow.api.chat_images import chat_prompt
from tinkerflow.api.endpoint_sampling import (
    RETRY_AFTER_S,
    check_request_caps,
    resolve_target,
    results,
    samplers_of,
    submit,
    token_budget,
)
from tinkerflow.api.image_checks import counted_off_loop
from tinkerflow.api.lookups import json_body
from tinkerflow.api.openai_images import message_images
from tinkerflow.api.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    _Common,
    first_error,
)
from tinkerflow.api.openai_render import (
    Rendered,
    chat_logprobs,
    completion_logprobs,
    echo_logprobs,
    render,
    usage,
)
from tinkerflow.api.openai_stream import stream as _stream
from tinkerflow.api.services import Services
from tinkerflow.common.errors import InputError
from tinkerflow.workflows.protocol.messages import ModelCard


def _stops(req: _Common) -> list[str] | None:
    """`req.stop` as validated: the field's validator turns a single string into a one-element list."""
    return cast("list[str] | None", req.stop)


def _error_response(e: OpenAIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(status_code=e.status, content=e.body(), headers=headers)


class OpenAIRoute(APIRoute):
    """Every error of these routes (auth, validation, lookups) in OpenAI's body shape, which its clients parse."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except OpenAIError as e:
                retry_after = {"Retry-After": str(e.retry_after_s or RETRY_AFTER_S)} if e.status == 429 else None
                return _error_response(e, retry_after)
            except HTTPException as e:
                code = {401: "invalid_api_key", 404: "not_found"}.get(e.status_code)
                return _error_response(OpenAIError(e.status_code, str(e.detail), None, code), e.headers)
            except (RequestValidationError, ValidationError) as e:
                return _error_response(OpenAIError(400, f"invalid request: {e}", None, "invalid_value"))

        return route


router = APIRouter(prefix="/v1", route_class=OpenAIRoute)


def _parse(model: type[_Common], raw: dict[str, Any]) -> Any:
    try:
        req = model.model_validate(raw)
    except ValidationError as e:
        raise first_error(e) from None
    bad = req.unsupported()
    if bad:
        raise OpenAIError(400, bad[1], bad[0], "unsupported_parameter")
    return req


def _tokens(prompt: str | list[int], tokenizer: Any, card: ModelCard) -> list[int]:
    if isinstance(prompt, str):
        tokens = list(tokenizer.encode(prompt))
    else:
        bad = [t for t in prompt if not 0 <= t < card.vocab_size]
        if bad:
            raise OpenAIError(
                400, f"token id {bad[0]} is outside the vocabulary [0, {card.vocab_size})", "prompt", "invalid_value"
            )
        tokens = list(prompt)
    if not tokens:
        raise OpenAIError(400, "the prompt is empty", "prompt", "invalid_value")
    return tokens


@router.post("/completions", response_model=None)
async def completions(
    request: Request, svc: Services = Depends(services), who: str = Depends(metrics_caller)
) -> dict | Response:
    req: CompletionRequest = _parse(CompletionRequest, await json_body(request))
    prompts = req.prompts()
    check_request_caps(svc, req.n * len(prompts), req.max_tokens, "max_tokens")
    target = await resolve_target(svc, req.model, who)
    samplers = samplers_of(request)
    tokenizer = await samplers.tokenizer(target.card.name, target.card.local_path)
    token_lists = [_tokens(p, tokenizer, target.card) for p in prompts]
    budgets = [token_budget(svc, target.card, t, req.max_tokens, "max_tokens") for t in token_lists]
    # echo scores the prompt (lm-eval-harness's loglikelihood); max_tokens 0 samples one token and drops it.
    score = req.logprobs if req.echo and req.logprobs is not None else None
    refs = [
        await submit(svc, samplers, who, target, t, req, max(b, 1), score)
        for t, b in zip(token_lists, budgets, strict=True)
    ]
    prompt_tokens = sum(len(t) for t in token_lists)
    responses: list[Any] = []

    async def choices() -> list[Rendered]:
        out = []
        responses.extend(await asyncio.gather(*(results(svc, r) for r in refs)))
        for response in responses:
            out.extend(
                render(tokenizer, s.tokens, s.logprobs, s.stop_reason, _stops(req))
                if req.max_tokens != 0
                else Rendered("", [], [], "length", 0)
                for s in response.sequences
            )
        return out

    meta = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "system_fingerprint": None,
    }
    if req.stream:
        return _stream(meta, choices(), prompt_tokens, req, chat=False)
    rendered = await choices()
    out = [
        {
            "index": i,
            "text": r.text,
            "finish_reason": r.finish_reason,
            "logprobs": completion_logprobs(r) if req.logprobs is not None else None,
        }
        for i, r in enumerate(rendered)
    ]
    if req.echo:
        for i, choice in enumerate(out):
            tokens, response = token_lists[i // req.n], responses[i // req.n]
            choice["text"] = tokenizer.decode(tokens, skip_special_tokens=True) + choice["text"]
            if req.logprobs is not None:
                choice["logprobs"] = echo_logprobs(
                    tokenizer,
                    tokens,
                    response.prompt_logprobs,
                    response.topk_prompt_logprobs if req.logprobs else None,
                    rendered[i],
                )
    return {**meta, "choices": out, "usage": usage(prompt_tokens, sum(r.completion_tokens for r in rendered))}


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    request: Request, svc: Services = Depends(services), who: str = Depends(metrics_caller)
) -> dict | Response:
    req: ChatCompletionRequest = _parse(ChatCompletionRequest, await json_body(request))
    limit = req.token_limit()
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    check_request_caps(svc, req.n, limit, field)
    target = await resolve_target(svc, req.model, who)
    images = message_images(req.messages)
    try:
        image_tokens = await counted_off_loop(images, target.card) if images else []
    except InputError as e:
        raise OpenAIError(400, str(e), "messages", "invalid_image") from None
    samplers = samplers_of(request)
    tokenizer = await samplers.tokenizer(target.card.name, target.card.local_path)
    if not getattr(tokenizer, "chat_template", None):
        raise OpenAIError(
            400,
            f"the tokenizer of {target.card.name} has no chat template; use /v1/completions "
            "with a prompt you format yourself",
            "messages",
            "no_chat_template",
        )
    try:
        messages = [m.as_template_input() for m in req.messages]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # the template itself raises on conversations it does not accept (roles, order)
        raise OpenAIError(400, f"the chat template refused these messages: {e}", "messages", "invalid_value") from None
    prompt = chat_prompt(tokenizer, text, images, image_tokens, target.card)
    ref = await submit(svc, samplers, who, target, prompt, req, token_budget(svc, target.card, prompt, limit, field))

    async def choices() -> list[Rendered]:
        response = await results(svc, ref)
        return [render(tokenizer, s.tokens, s.logprobs, s.stop_reason, _stops(req)) for s in response.sequences]

    meta = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "system_fingerprint": None,
    }
    if req.stream:
        return _stream({**meta, "object": "chat.completion.chunk"}, choices(), len(prompt), req, chat=True)
    rendered = await choices()
    return {
        **meta,
        "choices": [
            {
                "index": i,
                "message": {"role": "assistant", "content": r.text, "refusal": None},
                "finish_reason": r.finish_reason,
                "logprobs": chat_logprobs(r.pieces, r.logprobs) if req.logprobs else None,
            }
            for i, r in enumerate(rendered)
        ],
        "usage": usage(len(prompt), sum(r.completion_tokens for r in rendered)),
    }


@router.get("/models")
async def models(svc: Services = Depends(services), _: str = Depends(metrics_caller)) -> dict:
    cards = await svc.registry.cards()
    return {"object": "list", "data": [_model(c) for c in cards.values()]}


@router.get("/models/{model:path}")
async def model_info(model: str, svc: Services = Depends(services), _: str = Depends(metrics_caller)) -> dict:
    card = await svc.registry.get(model)
    if card is None:
        raise OpenAIError(404, f"the model {model!r} does not exist", "model", "model_not_found")
    return _model(card)


def _model(card: ModelCard) -> dict[str, Any]:
    return {
        "id": card.name,
        "object": "model",
        "created": 0,
        "owned_by": "tinkerflow",
        "max_model_len": card.max_context,
    }
