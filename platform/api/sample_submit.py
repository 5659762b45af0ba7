"""One sampling submission, shared by the Tinker `asample` route and the OpenAI-compatible routes.

Both go through the same checks (per-request caps, the coordinator's queue limit answered with 429 + Retry-After),
the same claim-check store and the same SampleBatcher, so an OpenAI call is batched with SDK calls in one decode pass
and counts against the same queue.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from tinker.types import SampleRequest

from tinkerflow.api.http_errors import from_temporal, http_error
from tinkerflow.api.quota_checks import Refusal
from tinkerflow.api.request_ids import BatchItemRef
from tinkerflow.api.services import Services
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import SamplerInfo

# What the engine samples when a request names no max_tokens (activities/wire.py sample_input).
DEFAULT_MAX_TOKENS = 16
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueueFull:
    """The coordinator's queue is over its limit: answer 429 with Retry-After (the SDK and openai clients back off)."""

    message: str
    retry_after_s: int = 1


def check_caps(
    svc: Services,
    num_samples: int,
    max_tokens: int | None,
    *,
    samples_field: str = "num_samples",
    tokens_field: str = "sampling_params.max_tokens",
) -> None:
    """400 naming the field when a request asks for more than this server gives one request."""
    limits = svc.settings
    if num_samples > limits.max_samples_per_request:
        raise http_error(
            400,
            f"{samples_field} {num_samples} is over this server's limit of "
            f"{limits.max_samples_per_request} per request (--max-samples-per-request)",
        )
    if max_tokens is not None and max_tokens > limits.max_sample_tokens:
        raise http_error(
            400,
            f"{tokens_field} {max_tokens} is over this server's limit of "
            f"{limits.max_sample_tokens} (--max-sample-tokens)",
        )


async def submit_sample(
    svc: Services, info: SamplerInfo, raw: dict[str, Any], req: SampleRequest
) -> BatchItemRef | QueueFull | Refusal:
    """Queue one checked sample request on `info`'s coordinator; where its outcome will be, QueueFull, or the
    caller's quota Refusal (quota_checks.py: each route answers it its own way)."""
    max_tokens = req.sampling_params.max_tokens
    # An image counts its placeholder tokens where the chunk says them (the SDK's ModelInput.length does so too).
    prompt_tokens = sum(
        len(getattr(c, "tokens", ()) or ()) or getattr(c, "expected_tokens", 0) or 0 for c in req.prompt.chunks
    )
    asked = max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS
    # The quota's reservation counts the prompt once, as the meter does; the queue's work counts it per sample.
    charge = svc.quotas.admit_sampling(info.owner, prompt_tokens + req.num_samples * asked)
    if isinstance(charge, Refusal):
        return charge
    try:
        ref = await _queue(svc, info, raw, req, req.num_samples * (prompt_tokens + asked))
    except BaseException:
        if charge is not None:
            svc.quotas.refund(charge)
        raise
    if charge is not None:
        if isinstance(ref, QueueFull):
            svc.quotas.refund(charge)
        else:
            svc.quotas.bind(charge, ref.workflow_id)
    return ref


async def _queue(
    svc: Services, info: SamplerInfo, raw: dict[str, Any], req: SampleRequest, work: int
) -> BatchItemRef | QueueFull:
    coordinator = names.coordinator_workflow_id(info.base_model, info.pool)
    limits = svc.settings
    # The queue is counted in work, not calls: samples, and tokens (samples x (prompt + max_tokens)).
    queued, queued_tokens = await svc.queued_samples(coordinator)
    if queued >= limits.max_queued_samples or queued_tokens >= limits.max_queued_sample_tokens:
        log.warning(
            "sample: %d samples (%d tokens) queued for %s; answering 429", queued, queued_tokens, info.base_model
        )
        return QueueFull(
            f"sampling queue for {info.base_model} is full ({queued} samples, {queued_tokens:,} tokens "
            "waiting); retry shortly"
        )
    # Counted before the next await, so the calls of a burst checked against one query answer see each other.
    svc.queue_depths.admitted(coordinator, req.num_samples, work)
    body = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    ref = await asyncio.to_thread(svc.store.put, body, "requests")  # fsspec I/O: off the event loop
    assert svc.sample_batcher is not None
    try:
        wf_id, index = await svc.sample_batcher.submit(info, ref, samples=req.num_samples, work=work)
    except Exception as e:
        svc.store.delete(ref)
        raise from_temporal(e, f"sampling session {info.sampler_id!r}") from None
    return BatchItemRef(wf_id, index, payload_uri=ref.uri)
