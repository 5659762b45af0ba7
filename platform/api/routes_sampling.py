"""Sampling routes: create_sampling_session, samplers/{id}, asample (docs/wire-contract.md §Sampling)."""

from __future__ import annotations

import asyncio
import logging
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from tinker.types import CreateSamplingSessionRequest, SampleRequest

from tinkerflow.api import request_ids, session_futures
from tinkerflow.api.caller import owner, services
from tinkerflow.api.http_errors import from_temporal, http_error
from tinkerflow.api.identifiers import check_sampler_id
from tinkerflow.api.image_checks import checked_off_loop, prompt_images
from tinkerflow.api.lookups import checkpoint_of_caller, json_body, session_of_caller
from tinkerflow.api.quota_checks import Refusal, too_many
from tinkerflow.api.request_ids import BatchItemRef
from tinkerflow.api.sample_submit import QueueFull, check_caps, submit_sample
from tinkerflow.api.services import Services
from tinkerflow.common import stability_records
from tinkerflow.common.errors import InputError
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import SamplerInfo, SamplerRequest
from tinkerflow.workflows.session import SessionWorkflow

router = APIRouter(prefix="/api/v1")
log = logging.getLogger(__name__)


@router.post("/create_sampling_session")
async def create_sampling_session(
    request: Request, svc: Services = Depends(services), who: str = Depends(owner)
) -> dict:
    req = CreateSamplingSessionRequest.model_validate(await json_body(request))
    await session_of_caller(svc, req.session_id, who)
    if req.model_path:
        # Any saved weights of the caller's (or published ones): sampler_weights, weights or external_weights.
        base_model = (await checkpoint_of_caller(svc, req.model_path, who)).base_model
        if await svc.registry.get(base_model) is None:
            raise http_error(400, f"{req.model_path} needs base model {base_model}, which no JAX worker serves")
    elif req.base_model:
        card = await svc.registry.get(req.base_model)
        if card is None:
            raise http_error(400, f"unknown base_model {req.base_model!r}")
        base_model = card.name
    else:
        raise http_error(400, "create_sampling_session needs base_model or model_path")
    handle = svc.client.get_workflow_handle(names.session_workflow_id(req.session_id))
    try:
        info = await handle.execute_update(
            SessionWorkflow.register_sampler,
            SamplerRequest(
                seq=req.sampling_session_seq_id,
                base_model=base_model,
                model_path=req.model_path or "",
                pool=svc.settings.pool,
            ),
            id=f"sampler-{req.sampling_session_seq_id}",
        )
    except Exception as e:
        raise from_temporal(e, f"session {req.session_id}") from None
    svc.samplers[info.sampler_id] = info
    return {"sampling_session_id": info.sampler_id, "type": "create_sampling_session"}


async def resolve_sampler(svc: Services, sampler_id: str, who: str) -> SamplerInfo:
    """The sampler, or 404 when it does not exist or belongs to another tenant (the same answer for both)."""
    info = await _resolve_sampler(svc, sampler_id)
    if info.owner != who:
        raise http_error(404, f"sampling session {sampler_id!r} does not exist or has ended")
    return info


async def _resolve_sampler(svc: Services, sampler_id: str) -> SamplerInfo:
    check_sampler_id(sampler_id)
    cached = svc.samplers.get(sampler_id)
    if cached is not None:
        return cached
    handle = svc.client.get_workflow_handle(names.session_workflow_id(names.session_of(sampler_id)))
    try:
        info = await handle.execute_update(SessionWorkflow.resolve_sampler, sampler_id)
    except Exception as e:
        err = from_temporal(e, f"sampling session {sampler_id!r}")
        if err.status_code == 400:
            err.status_code = 404
        raise err from None
    svc.samplers[sampler_id] = info
    return info


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    info = await resolve_sampler(svc, sampler_id, who)
    out = {"sampler_id": info.sampler_id, "base_model": info.base_model}
    if info.model_path:
        out["model_path"] = info.model_path
    return out


async def _prompt_problem(svc: Services, base_model: str, req: SampleRequest) -> str:
    """What is wrong with the prompt's images ("" when it has none)."""
    try:
        images = prompt_images(list(req.prompt.chunks))
    except InputError as e:
        return f"sample: {e}"
    if not images:
        return ""
    card = await svc.registry.get(base_model)
    if card is None:
        return f"sample: base model {base_model!r} is not served right now, so its images cannot be checked"
    problem = await checked_off_loop(images, card)
    return f"sample: {problem}" if problem else ""


async def _failed_sample(svc: Services, sampler_id: str, seq_id: int | None, message: str, who: str) -> dict:
    """A sample call's future failed with `message` (category user) before anything was queued."""
    call = f"{sampler_id}#{seq_id}" if seq_id is not None else uuid.uuid4().hex
    failed = request_ids.encode(request_ids.FailedRef(message, call=call), svc.signing_key, who)
    if seq_id is not None:
        await asyncio.to_thread(session_futures.record, svc, sampler_id, seq_id, failed, "")
    return {"request_id": failed, "sample_sequence_ids": []}


@router.post("/asample", response_model=None)
async def asample(
    request: Request, svc: Services = Depends(services), who: str = Depends(owner)
) -> dict | JSONResponse:
    raw = await json_body(request)
    req = SampleRequest.model_validate(raw)
    check_caps(svc, req.num_samples, req.sampling_params.max_tokens)
    if not req.sampling_session_id:
        raise http_error(400, "asample needs a sampling_session_id (create one with create_sampling_session)")
    info = await resolve_sampler(svc, req.sampling_session_id, who)
    problem = await _prompt_problem(svc, info.base_model, req)
    if problem:  # the call's future fails as the sender's error, as a bad training datum's does
        return await _failed_sample(svc, info.sampler_id, req.seq_id, problem, who)
    ref = await submit_sample(svc, info, raw, req)
    if isinstance(ref, QueueFull):
        return JSONResponse(
            status_code=429, headers={"Retry-After": str(ref.retry_after_s)}, content={"detail": ref.message}
        )
    if isinstance(ref, Refusal):
        if not ref.daily:
            raise too_many(ref)
        # The SDK retries a 429 on asample every second without end: past a daily quota it would wait for
        # midnight in silence, so the call's future fails with the reason instead (quota_checks.py).
        return await _failed_sample(svc, info.sampler_id, req.seq_id, ref.message, who)
    wf_id, index = ref.workflow_id, ref.index
    request_id = request_ids.encode(ref, svc.signing_key, who)
    if req.seq_id is not None:  # for the session's retrieve_futures poll and cancel_future
        await asyncio.to_thread(session_futures.record, svc, info.sampler_id, req.seq_id, request_id, ref.payload_uri)
    if req.record_stability_info:  # before the answer: a client can name these sequences only after it
        await asyncio.to_thread(stability_records.write_call, svc.store, stability_record(info, ref, who))
    # A retried call (same seq_id) may land in another batch and sample again: sampling changes no state, and the
    # client only ever sees one of the answers.
    return {
        "request_id": request_id,
        "sample_sequence_ids": [f"{wf_id}#{index}#{i}" for i in range(req.num_samples)],
    }


def stability_record(info: SamplerInfo, ref: BatchItemRef, who: str) -> stability_records.CallRecord:
    """The API's half of a call's stability record (tinkerflow.common.stability_records): which call, body and
    session."""
    weights = stability_records.Weights(info.sampler_id, info.base_model, info.model_path, info.snapshot)
    session = names.session_of(info.sampler_id)
    return stability_records.CallRecord(f"{ref.workflow_id}#{ref.index}", ref.payload_uri, who, session, weights)
