"""The sampling session's batch routes: retrieve_futures (one long-poll for many samples), join_sampling_session (a
clone's id) and cancel_future (docs/wire-contract.md §Futures). Each checks the caller as retrieve_future does:
another tenant's sampler or request id answers 404, as one that does not exist."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends, Request
from tinker.types import FuturesRetrieveRequest, JoinSamplingSessionRequest

from tinkerflow.api import request_ids, session_futures
from tinkerflow.api.caller import owner, services
from tinkerflow.api.http_errors import from_error, from_temporal, http_error
from tinkerflow.api.lookups import json_body
from tinkerflow.api.routes_sampling import resolve_sampler
from tinkerflow.api.services import Services
from tinkerflow.common.store import write_whole
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.session import SessionWorkflow

router = APIRouter(prefix="/api/v1")
log = logging.getLogger(__name__)


@router.post("/retrieve_futures")
async def retrieve_futures(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    try:
        req = FuturesRetrieveRequest.model_validate(await json_body(request))
    except ValueError as e:
        raise http_error(400, f"malformed retrieve_futures request: {e}") from None
    target = req.target
    await resolve_sampler(svc, target.sampling_session_id, who)
    completions, cursor = await session_futures.poll(
        svc,
        target.sampling_session_id,
        target.cloned_sampler_id,
        who,
        req.prev_cursor,
        req.timeout,
        [str(r) for r in req.retrieved_request_ids],
    )
    return {"completions": completions, "cursor": cursor}


@router.post("/join_sampling_session")
async def join_sampling_session(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    try:
        req = JoinSamplingSessionRequest.model_validate(await json_body(request))
    except ValueError as e:
        raise http_error(400, f"malformed join_sampling_session request: {e}") from None
    await resolve_sampler(svc, req.sampling_session_id, who)
    handle = svc.client.get_workflow_handle(names.session_workflow_id(names.session_of(req.sampling_session_id)))
    try:
        counter = await handle.execute_update(SessionWorkflow.join_sampler, req.sampling_session_id)
    except Exception as e:
        raise from_temporal(e, f"sampling session {req.sampling_session_id!r}") from None
    return {"client_counter": counter, "type": "join_sampling_session"}


@router.post("/cancel_future")
async def cancel_future(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    """A sample still queued never runs (its future fails, category user); a training op is in its run's sequence
    and cannot be skipped (400 saying so); a finished future is left as it is."""
    request_id = (await json_body(request)).get("request_id", "")
    try:
        ref = request_ids.decode(request_id, svc.signing_key, who)
    except request_ids.BadRequestId as e:
        raise from_error(e) from None
    if not isinstance(ref, request_ids.BatchItemRef):
        raise http_error(
            400,
            "this future cannot be cancelled: training ops run in their run's seq_id order and each one's place in "
            "the sequence is kept (only queued samples can be cancelled)",
        )
    sampler_id = ref.workflow_id.removeprefix("sample/").rsplit("/", 1)[0]
    payload = await asyncio.to_thread(session_futures.find_payload, svc, sampler_id, request_id)
    if payload is None:
        return {"status": "not cancelled: the sample finished or its result was retrieved"}
    marker = svc.store.cancel_marker(payload)
    await asyncio.to_thread(svc.store.fs.makedirs, marker.rsplit("/", 1)[0], exist_ok=True)
    await asyncio.to_thread(write_whole, svc.store.fs, marker, request_id.encode())
    log.info("cancel_future: sample %s of %s marked cancelled", ref.index, ref.workflow_id)
    return {"status": "cancelled unless it already ran"}
