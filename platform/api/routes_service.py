"""Handshake, sessions, telemetry and capabilities (docs/wire-contract.md §Sessions and heartbeats, §Routes)."""

from __future__ import annotations

import json
import uuid

from fastapi import APIRouter, Depends, HTTPException, Request
from temporalio.common import WorkflowIDConflictPolicy
from tinker.types import CreateSessionRequest

from tinkerflow.api.caller import owner, services
from tinkerflow.api.http_errors import from_temporal, http_error, is_not_found
from tinkerflow.api.identifiers import check_session_id
from tinkerflow.api.lookups import json_body, session_of_caller
from tinkerflow.api.op_checks import check_metadata
from tinkerflow.api.services import Services
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import SessionStart
from tinkerflow.workflows.session import SessionWorkflow

router = APIRouter(prefix="/api/v1")


@router.post("/client/config")
async def client_config(svc: Services = Depends(services), _: str = Depends(owner)) -> dict:
    # zstd keeps big forward_backward bodies small on the wire; the adapter decompresses with a size cap.
    # One long-poll per sampling session instead of one per sample, and server-numbered clones of a sampler
    # (routes_session_futures.py); custom losses uploaded by create_custom_loss run in the engine's step
    # (docs/custom-losses.md). The transport: settings_api.py's client_transport says why httpx by default.
    return {
        "pjwt_auth_enabled": False,
        "proto_compress_fwdbwd": True,
        "use_pyqwest_transport": svc.settings.client_transport == "pyqwest",
        "sample_use_retrieve_futures": True,
        "sample_join_sampling_session": True,
        "custom_loss_server_side": True,
    }


@router.post("/client/dynamic_config")
async def dynamic_config(_: str = Depends(owner)) -> dict:
    return {}


@router.get("/healthz")
async def healthz() -> dict:
    return {"status": "ok"}


@router.post("/telemetry")
async def telemetry(_: str = Depends(owner)) -> dict:
    return {"status": "accepted"}


@router.get("/get_server_capabilities")
async def capabilities(svc: Services = Depends(services), _: str = Depends(owner)) -> dict:
    cards = await svc.registry.cards()
    return {
        "supported_models": [
            {"model_name": c.name, "max_context_length": c.max_context, "trainable": True, "sampleable": True}
            for c in cards.values()
        ]
    }


@router.post("/create_session")
async def create_session(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    req = CreateSessionRequest.model_validate(await json_body(request))
    check_metadata(req.user_metadata)
    session_id = f"sess-{uuid.uuid4().hex[:12]}"
    start = SessionStart(
        session_id=session_id,
        owner=who,
        tags=list(req.tags),
        user_metadata=req.user_metadata or {},
        sdk_version=req.sdk_version,
        heartbeat_timeout_s=svc.settings.session_timeout_s,
        display_name=req.display_name or "",
    )
    tags = f" · tags {', '.join(req.tags)}" if req.tags else ""
    await svc.client.start_workflow(
        SessionWorkflow.run,
        args=[start, None],
        id=names.session_workflow_id(session_id),
        task_queue=names.WORKFLOW_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        search_attributes=names.search_attributes(
            (names.SESSION_ID, session_id), (names.STATUS, "active"), (names.OWNER, names.owner_value(who))
        ),
        static_summary=f"Tinker session {session_id}" + (f" ({req.display_name})" if req.display_name else "") + tags,
        static_details=f"sdk {req.sdk_version}; user_metadata {json.dumps(req.user_metadata or {})[:500]}",
        # Listings return the memo with each row: the console searches sessions (and their runs) by this name
        # without asking every session's workflow.
        memo={"display_name": req.display_name} if req.display_name else None,
    )
    return {"session_id": session_id, "type": "create_session"}


@router.post("/session_heartbeat")
async def heartbeat(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    session_id = check_session_id((await json_body(request)).get("session_id", ""))
    handle = svc.client.get_workflow_handle(names.session_workflow_id(session_id))
    # 410 tells the SDK to stop heartbeating (docs/wire-contract.md §Sessions and heartbeats); another tenant's session
    # gets the same answer as an unknown one, so nobody can keep someone else's session (and its adapter slots) alive.
    gone = http_error(410, f"session {session_id} has finished")
    try:
        # describe() reads the owner search attribute from the server, without a workflow task (unlike a query).
        described = await handle.describe()
        if described.typed_search_attributes.get(names.OWNER) != names.owner_value(who):
            raise gone
        await handle.signal(SessionWorkflow.heartbeat)
    except HTTPException:
        raise
    except Exception as e:
        if is_not_found(e):
            raise gone from None
        raise from_temporal(e, f"session {session_id}") from None
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish(
    session_id: str, request: Request, svc: Services = Depends(services), who: str = Depends(owner)
) -> dict:
    body = await json_body(request)
    # Queries answer on closed workflows too: a finished session passes, another tenant's or an unknown one is 404.
    await session_of_caller(svc, session_id, who)
    reason = (body.get("reason") or {}).get("type", "success")
    detail = body.get("detail")
    try:
        await svc.client.get_workflow_handle(names.session_workflow_id(session_id)).signal(
            SessionWorkflow.finish, f"client finished: {reason}" + (f" ({detail})" if detail else "")
        )
    except Exception as e:
        if not is_not_found(e):  # finishing a finished session is fine
            raise from_temporal(e, f"session {session_id}") from None
    return {}
