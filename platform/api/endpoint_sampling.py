"""What the OpenAI-compatible (routes_openai.py) and Anthropic-compatible (routes_anthropic.py) endpoints share: a
`model` resolved to a served base model or readable saved weights, the per-request caps and the context budget, one
prompt submitted through the Tinker sampling path, and the wait for its result.

Errors are raised as OpenAIError, whose (status, message, param, code) carry everything either endpoint's error shape
needs: routes_openai answers them as they are, routes_anthropic turns them into Anthropic's shape by status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import HTTPException, Request
from temporalio.client import WorkflowFailureError
from tinker.proto.response_conv import deserialize_sample_response
from tinker.types import SampleRequest

from tinkerflow.api.chat_images import ChatPrompt
from tinkerflow.api.lookups import checkpoint_of_caller
from tinkerflow.api.openai_models import OpenAIError
from tinkerflow.api.openai_samplers import OpenAISamplers
from tinkerflow.api.quota_checks import Refusal
from tinkerflow.api.request_ids import BatchItemRef
from tinkerflow.api.sample_submit import QueueFull, check_caps, submit_sample
from tinkerflow.api.services import Services
from tinkerflow.workflows.protocol.messages import ModelCard

# What a 429 (the coordinator's queue is full) tells clients to wait: both SDKs back off and retry.
RETRY_AFTER_S = 1


class Knobs(Protocol):
    """The sampling parameters one submission reads (OpenAI's request models carry them as fields)."""

    @property
    def n(self) -> int: ...
    @property
    def temperature(self) -> float: ...
    @property
    def top_p(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def stop(self) -> Any: ...


def samplers_of(request: Request) -> OpenAISamplers:
    """The API process's samplers and tokenizers, one set for both endpoints (a tenant's one session serves both)."""
    state = getattr(request.app.state, "openai_samplers", None)
    if state is None:
        state = request.app.state.openai_samplers = OpenAISamplers()
    return state


@dataclass(frozen=True)
class Target:
    card: ModelCard
    model_path: str  # "" for the base model


async def resolve_target(svc: Services, model: str, who: str) -> Target:
    if model.startswith("tinker://"):
        try:
            base = (await checkpoint_of_caller(svc, model, who)).base_model
        except HTTPException as e:  # 404: unknown, expired or another tenant's private checkpoint
            raise OpenAIError(404 if e.status_code == 404 else 400, str(e.detail), "model", "model_not_found") from None
        card = await svc.registry.get(base)
        if card is None:
            raise OpenAIError(
                404, f"{model} needs base model {base}, which no JAX worker serves", "model", "model_not_found"
            )
        return Target(card, model)
    card = await svc.registry.get(model)
    if card is None:
        raise OpenAIError(
            404,
            f"the model {model!r} does not exist: use a served base model (GET /v1/models) or a "
            "tinker:// path of your saved weights",
            "model",
            "model_not_found",
        )
    return Target(card, "")


def check_request_caps(svc: Services, n: int, max_tokens: int | None, tokens_field: str) -> None:
    try:
        check_caps(svc, n, max_tokens, samples_field="n", tokens_field=tokens_field)
    except HTTPException as e:
        param = "n" if str(e.detail).startswith("n ") else tokens_field
        raise OpenAIError(400, str(e.detail), param, "invalid_value") from None


def token_budget(svc: Services, card: ModelCard, prompt: Sized, max_tokens: int | None, field: str) -> int:
    """max_tokens checked against the context (prompt + completion), or what the context leaves when unset."""
    room = card.max_context - len(prompt)
    asked = max_tokens if max_tokens is not None else min(room, svc.settings.max_sample_tokens)
    if room < 1 or len(prompt) + asked > card.max_context:
        raise OpenAIError(
            400,
            f"this model's context is {card.max_context} tokens; the prompt has {len(prompt)} and "
            f"{field} asks for {asked}",
            field if room >= 1 else "prompt",
            "context_length_exceeded",
        )
    return asked


async def submit(
    svc: Services,
    samplers: OpenAISamplers,
    who: str,
    target: Target,
    prompt: list[int] | ChatPrompt,
    req: Knobs,
    max_tokens: int,
    topk_prompt: int | None = None,
) -> BatchItemRef:
    """Submit one prompt (token ids, or a chat's chunks with its images); `topk_prompt` (not None) also scores the
    prompt, with that many alternatives per token."""
    info = await samplers.sampler(svc, who, target.card.name, target.model_path)
    raw: dict[str, Any] = {
        "sampling_session_id": info.sampler_id,
        "seq_id": 0,
        "num_samples": req.n,
        "prompt": {"chunks": (prompt if isinstance(prompt, ChatPrompt) else ChatPrompt.of_tokens(prompt)).chunks},
        "sampling_params": {
            "max_tokens": max_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "seed": req.seed,
            "stop": req.stop,
        },
    }
    if topk_prompt is not None:
        raw.update(prompt_logprobs=True, topk_prompt_logprobs=topk_prompt)
    ref = await submit_sample(svc, info, raw, SampleRequest.model_validate(raw))
    if isinstance(ref, QueueFull):
        raise OpenAIError(429, ref.message, None, "rate_limit_exceeded")
    if isinstance(ref, Refusal):  # OpenAI's codes: a used-up quota, or a rate limit
        code = "insufficient_quota" if ref.daily else "rate_limit_exceeded"
        raise OpenAIError(400 if ref.never else 429, ref.message, None, code, ref.retry_after_s)
    return ref


async def results(svc: Services, ref: BatchItemRef) -> Any:
    """Wait for the outcome of one submitted request (what retrieve_future long-polls), as the SDK's SampleResponse."""
    try:
        outcome = await svc.batch_results.outcome(ref.workflow_id, ref.index)
    except WorkflowFailureError as e:
        raise OpenAIError(
            500, f"sampling failed: {getattr(e.cause, 'message', None) or e}", None, "server_error"
        ) from None
    if not outcome.ok:
        status = 400 if outcome.category == "user" else 500
        raise OpenAIError(status, outcome.error or "sampling failed", None, "sampling_failed")
    assert outcome.blob is not None
    return deserialize_sample_response(await asyncio.to_thread(svc.store.get, outcome.blob))
