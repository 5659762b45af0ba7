"""Training runs and sessions of the RestClient (docs/wire-contract.md §RestClient routes): found through Temporal
visibility, read by query.

Every session and run workflow carries the `TinkerflowOwner` search attribute, so a listing is one visibility query
for the caller's own workflows; the details come from each workflow's `describe` query (which also answers for
closed workflows). Checkpoint facts come from the checkpoint root, where they are true.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from tinker.types import SessionSearchRequest

from tinkerflow.api.caller import owner, services
from tinkerflow.api.http_errors import from_temporal, http_error
from tinkerflow.api.identifiers import check_project_id, check_session_id
from tinkerflow.api.lookups import json_body, run_of_caller, session_of_caller
from tinkerflow.api.services import Services
from tinkerflow.common.checkpoints import TinkerPath
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import RunState, SessionState
from tinkerflow.workflows.session import SessionWorkflow
from tinkerflow.workflows.training_run import TrainingRunWorkflow

router = APIRouter(prefix="/api/v1")


def _owned_query(workflow_type: str, who: str) -> str:
    # Continue-as-new leaves one closed execution per run behind; only the latest one is the session or run.
    return (
        f"WorkflowType = '{workflow_type}' AND {names.OWNER.name} = '{names.owner_value(who)}' "
        "AND ExecutionStatus != 'ContinuedAsNew'"
    )


async def _ids(svc: Services, workflow_type: str, who: str, prefix: str) -> list[str]:
    ids: list[str] = []
    async for wf in svc.client.list_workflows(_owned_query(workflow_type, who)):
        if wf.id.startswith(prefix) and wf.id[len(prefix) :] not in ids:
            ids.append(wf.id[len(prefix) :])
    return ids  # newest first: visibility orders by start time


async def _checkpoint(svc: Services, path: str) -> dict[str, Any] | None:
    if not path:
        return None
    m = await asyncio.to_thread(svc.checkpoints.manifest, TinkerPath.parse(path))
    return m.as_checkpoint() if m is not None else None


async def _training_run(svc: Services, state: RunState) -> dict[str, Any]:
    start = state.start
    return {
        "training_run_id": start.model_id,
        "base_model": start.base_model,
        "model_owner": start.owner or "open",
        "is_lora": True,
        "corrupted": state.status == "failed",
        "lora_rank": state.lora_spec.rank,
        "last_request_time": state.last_request_time or "1970-01-01T00:00:00Z",
        "last_checkpoint": await _checkpoint(svc, state.last_checkpoint),
        "last_sampler_checkpoint": await _checkpoint(svc, state.last_sampler_checkpoint),
        "user_metadata": {str(k): str(v) for k, v in start.user_metadata.items()},
    }


@router.get("/training_runs")
async def list_training_runs(
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0),
    svc: Services = Depends(services),
    who: str = Depends(owner),
) -> dict:
    ids = await _ids(svc, "TrainingRun", who, "training-run/")
    page = ids[offset : offset + limit]
    runs = []
    for model_id in page:
        try:
            state = await svc.client.get_workflow_handle(names.run_workflow_id(model_id)).query(
                TrainingRunWorkflow.describe
            )
        except Exception as e:
            raise from_temporal(e, f"training run {model_id}") from None
        runs.append(await _training_run(svc, state))
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)}}


@router.get("/training_runs/{run}")
async def get_training_run(run: str, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    return await _training_run(svc, await run_of_caller(svc, run, who))


@router.get("/sessions")
async def list_sessions(
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0),
    svc: Services = Depends(services),
    who: str = Depends(owner),
) -> dict:
    ids = await _ids(svc, "Session", who, "session/")
    return {"sessions": ids[offset : offset + limit]}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    s = await session_of_caller(svc, session_id, who)
    return {
        "training_run_ids": list(s.training_run_ids),
        "sampler_ids": sorted(s.samplers),
        "user_metadata": _metadata(s),
        "display_name": s.display_name or None,
    }


@router.put("/sessions/{session_id}/project")
async def assign_project(
    session_id: str, request: Request, svc: Services = Depends(services), who: str = Depends(owner)
) -> dict:
    """Projects are labels here (one tenant per API key): recorded on the session, shown by search_sessions."""
    project_id = check_project_id((await json_body(request)).get("project_id"))
    await session_of_caller(svc, session_id, who)
    try:
        await svc.client.get_workflow_handle(names.session_workflow_id(session_id)).signal(
            SessionWorkflow.set_project, project_id
        )
    except Exception as e:
        raise from_temporal(e, f"session {session_id}") from None
    return {}


@router.get("/sessions/{session_id}/trace_export")
async def trace_export(session_id: str, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    await session_of_caller(svc, session_id, who)
    return {
        "status": "failed",
        "error": "Perfetto trace export is not supported by this server; the session's "
        f"timeline is its Temporal history (workflow session/{session_id} and its training-run/… workflows)",
    }


@router.post("/sessions/search")
async def search_sessions(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    """The caller's sessions, newest first, filtered as SessionSearchRequest says; cursor = the last one returned."""
    req = SessionSearchRequest.model_validate(await json_body(request))
    if req.owner.type == "user":
        raise http_error(400, "searching other users' sessions is not supported; search your own (owner 'own')")
    if req.project_ids is not None:
        raise http_error(400, "project filters are not supported by this server's session search")
    query = _owned_query("Session", who)
    if req.session_id:
        check_session_id(req.session_id)  # it goes into the visibility query: no quotes, nothing but an id
        query += f" AND WorkflowId = '{names.session_workflow_id(req.session_id)}'"
    after = (req.cursor.last_created_at, req.cursor.last_session_id) if req.cursor else None
    by_run = _checkpoints_by_run(await asyncio.to_thread(svc.checkpoints.list))
    found: list[dict[str, Any]] = []
    async for wf in svc.client.list_workflows(query):
        session_id = wf.id.removeprefix("session/")
        created = wf.start_time
        if after is not None and (created, session_id) >= after:
            continue
        s: SessionState = await svc.client.get_workflow_handle(wf.id).query(SessionWorkflow.describe)
        status = _status(s)
        if not _matches(req, s, status):
            continue
        ckpts = [m for run in s.training_run_ids for m in by_run.get(run, [])]
        found.append(
            {
                "session_id": session_id,
                "created_at": created.isoformat(),
                "owner": s.owner or "open",
                "project_id": s.project_id,
                "status": status,
                "checkpoints_count": len(ckpts),
                "checkpoint_storage_bytes": sum(m.size_bytes for m in ckpts),
                "display_name": s.display_name or None,
                "user_metadata": _metadata(s),
            }
        )
        if len(found) > req.limit:
            break
    page = found[: req.limit]
    more = len(found) > req.limit
    return {
        "sessions": page,
        "next_cursor": {"last_created_at": page[-1]["created_at"], "last_session_id": page[-1]["session_id"]}
        if more
        else None,
    }


def _metadata(s: SessionState) -> dict[str, str] | None:
    return {str(k): str(v) for k, v in s.user_metadata.items()} or None


def _checkpoints_by_run(manifests) -> dict[str, list]:
    out: dict[str, list] = {}
    for m in manifests:
        out.setdefault(m.path.run, []).append(m)
    return out


def _status(s: SessionState) -> dict[str, Any]:
    """SessionStatus: active, client_finished (the SDK's close reason, as the finish route recorded it), or
    cancelled (no heartbeat within the timeout)."""
    if s.status == "active":
        return {"type": "active"}
    if s.status == "timed_out":
        return {"type": "cancelled", "detail": s.reason}
    reason = s.reason.removeprefix("client finished: ").split(" ", 1)[0]
    return {
        "type": "client_finished",
        "reason": {"type": reason if reason in ("success", "errored", "interrupted") else "success"},
        "detail": s.reason,
    }


def _matches(req: SessionSearchRequest, s: SessionState, status: dict[str, Any]) -> bool:
    if any(s.user_metadata.get(k) != v for k, v in req.user_metadata.items()):
        return False
    if req.display_name and not all(w.lower() in s.display_name.lower() for w in req.display_name.split()):
        return False
    if req.statuses:
        for q in req.statuses:
            if q.type == status["type"] and (
                q.type != "client_finished" or not q.reasons or status["reason"]["type"] in q.reasons
            ):
                return True
        return False
    return True
