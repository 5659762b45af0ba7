"""The console's JSON (docs/console.md): the caller's runs and sessions a page at a time, one run's facts, and the
service's workers and queues. Same key and tenancy as every /api/v1 route: the console page sends the key as
X-API-Key from its fetch calls, so these routes are plain API routes and any client may use them.

Listings filter and page on Temporal visibility (owner, type and id), so a page costs one visibility scan plus one
`describe` query per row shown, however many runs the caller has. A row whose query does not answer (a closed run
whose history a busy worker has not replayed yet) still shows, with the coarse status and step of its search
attributes.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Query
from temporalio.client import WorkflowExecution

from tinkerflow.api import console_status
from tinkerflow.api.caller import owner, services
from tinkerflow.api.lookups import run_of_caller
from tinkerflow.api.services import Services
from tinkerflow.common.tenancy import tenant_mode
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import RunState, SessionState
from tinkerflow.workflows.session import SessionWorkflow
from tinkerflow.workflows.training_run import TrainingRunWorkflow

log = logging.getLogger(__name__)
router = APIRouter(prefix="/api/v1/console")
MAX_QUERY_CHARS = 200


@dataclass(frozen=True)
class Listed:
    """One of the caller's workflows as visibility lists it: no workflow task needed."""

    id: str  # the model id or session id (the workflow id without its prefix)
    started: datetime | None
    status: str  # the TinkerflowStatus search attribute (coarse: set on change)
    step: int | None  # the TinkerflowStep search attribute (coarse: every few steps)
    base_model: str
    session_id: str
    name: str = ""  # a session's display name, from its memo (sessions created before it was recorded: "")


def _owned(workflow_type: str, who: str) -> str:
    # The same filter as the REST listings (routes_runs): continue-as-new leaves closed executions behind.
    return (
        f"WorkflowType = '{workflow_type}' AND {names.OWNER.name} = '{names.owner_value(who)}' "
        "AND ExecutionStatus != 'ContinuedAsNew'"
    )


async def _listed(wf: WorkflowExecution, prefix: str) -> Listed:
    attrs = wf.typed_search_attributes
    name = ""
    if prefix == "session/":
        try:
            name = str((await wf.memo()).get("display_name") or "")
        except Exception as e:  # a memo this API cannot decode: the row is still listed, by id
            log.debug("console: memo of %s: %s", wf.id, e)
    return Listed(
        name=name,
        id=wf.id.removeprefix(prefix),
        started=wf.start_time,
        status=attrs.get(names.STATUS) or "",
        step=attrs.get(names.STEP),
        base_model=attrs.get(names.BASE_MODEL) or "",
        session_id=attrs.get(names.SESSION_ID) or "",
    )


async def _listing(svc: Services, workflow_type: str, prefix: str, who: str) -> list[Listed]:
    """The caller's workflows of one type, newest first (visibility's order), each id once."""
    seen: set[str] = set()
    out: list[Listed] = []
    async for wf in svc.client.list_workflows(_owned(workflow_type, who)):
        if wf.id.startswith(prefix) and wf.id not in seen:
            seen.add(wf.id)
            out.append(await _listed(wf, prefix))
    return out


def _found(needle: str, *texts: str) -> bool:
    return not needle or any(needle in t.lower() for t in texts)


async def _matching_sessions(svc: Services, who: str, q: str) -> list[Listed]:
    """The caller's sessions whose id or display name holds `q`, case-insensitively.

    The search runs here rather than in the visibility query: the SQLite visibility store of the dev server has no
    substring operator, and `q` never becomes query text; a scan of hundreds of short rows costs milliseconds."""
    needle = q.strip().lower()
    return [s for s in await _listing(svc, "Session", "session/", who) if _found(needle, s.id, s.name)]


async def _matching_runs(svc: Services, who: str, q: str) -> list[Listed]:
    """The caller's runs whose id, base model or session's display name holds `q`."""
    needle = q.strip().lower()
    runs = await _listing(svc, "TrainingRun", "training-run/", who)
    if not needle:
        return runs
    names_of = {s.id: s.name for s in await _listing(svc, "Session", "session/", who)}
    return [
        r for r in runs if _found(needle, r.id, r.base_model, names_of.get(r.session_id or names.session_of(r.id), ""))
    ]


async def _describe_run(svc: Services, model_id: str) -> RunState | None:
    try:
        return await svc.client.get_workflow_handle(names.run_workflow_id(model_id)).query(TrainingRunWorkflow.describe)
    except Exception as e:  # the row still shows, from its search attributes
        log.debug("console: run %s not described: %s", model_id, e)
        return None


async def _describe_session(svc: Services, session_id: str) -> SessionState | None:
    try:
        return await svc.client.get_workflow_handle(names.session_workflow_id(session_id)).query(
            SessionWorkflow.describe
        )
    except Exception as e:
        log.debug("console: session %s not described: %s", session_id, e)
        return None


def _time(t: datetime | None) -> str | None:
    return t.isoformat() if t else None


def _run_row(row: Listed, state: RunState | None) -> dict[str, Any]:
    shown = console_status.of_run(state) if state else console_status.run_shown(row.status, "")
    return {
        "training_run_id": row.id,
        "session_id": row.session_id or names.session_of(row.id),
        "base_model": state.start.base_model if state else row.base_model,
        "status": shown.status,
        "reason": shown.reason or None,
        "step": state.step if state else row.step,
        "last_loss": state.last_loss if state else None,
        "started": _time(row.started),
        "last_request_time": (state.last_request_time or None) if state else None,
    }


def temporal_ui_link(svc: Services, workflow_id: str) -> str:
    base = svc.settings.resolved_temporal_ui_url
    namespace = quote(svc.settings.temporal_namespace, safe="")
    return f"{base}/namespaces/{namespace}/workflows/{quote(workflow_id, safe='')}"


@router.get("/runs")
async def runs(
    q: str = Query(
        "", max_length=MAX_QUERY_CHARS, description="substring of the run id, its base model or its session's name"
    ),
    offset: int = Query(0, ge=0),
    limit: int = Query(25, ge=1, le=200),
    svc: Services = Depends(services),
    who: str = Depends(owner),
) -> dict:
    found = await _matching_runs(svc, who, q)
    page = found[offset : offset + limit]
    states = await asyncio.gather(*(_describe_run(svc, r.id) for r in page))
    return {
        "training_runs": [_run_row(r, s) for r, s in zip(page, states)],
        "offset": offset,
        "limit": limit,
        "total": len(found),
    }


@router.get("/sessions")
async def sessions(
    q: str = Query("", max_length=MAX_QUERY_CHARS, description="substring of the session id or name"),
    offset: int = Query(0, ge=0),
    limit: int = Query(25, ge=1, le=200),
    svc: Services = Depends(services),
    who: str = Depends(owner),
) -> dict:
    found = await _matching_sessions(svc, who, q)
    page = found[offset : offset + limit]
    states = await asyncio.gather(*(_describe_session(svc, r.id) for r in page))
    shown = [
        console_status.of_session(s) if s else console_status.session_shown(r.status, "") for r, s in zip(page, states)
    ]
    rows = [
        {
            "session_id": r.id,
            "display_name": (s.display_name if s else r.name) or None,
            "status": how.status,
            "reason": how.reason or None,
            "training_run_ids": list(s.training_run_ids) if s else [],
            "samplers": len(s.samplers) if s else None,
            "started": _time(r.started),
        }
        for r, s, how in zip(page, states, shown)
    ]
    return {"sessions": rows, "offset": offset, "limit": limit, "total": len(found)}


@router.get("/runs/{run_id}")
async def run(run_id: str, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    """One run: its facts, its checkpoints (sizes, expiry) and its workflow in the Temporal UI; 404 as for
    GET /api/v1/training_runs/{id} when it is another tenant's or unknown."""
    state = await run_of_caller(svc, run_id, who)
    manifests = await asyncio.to_thread(svc.checkpoints.list, run_id)  # unexpired, newest first
    checkpoints = [m.as_checkpoint() for m in manifests]
    shown = console_status.of_run(state)
    return {
        "training_run_id": run_id,
        "session_id": state.start.session_id,
        "base_model": state.start.base_model,
        "lora_rank": state.lora_spec.rank,
        "status": shown.status,
        "reason": shown.reason or None,
        "step": state.step,
        "forward_backward_count": state.fwdbwd_count,
        "tokens_seen": state.tokens_seen,
        "last_loss": state.last_loss,
        "last_request_time": state.last_request_time or None,
        "recoveries": state.recoveries,
        "checkpoints": checkpoints,
        "temporal_ui_url": temporal_ui_link(svc, names.run_workflow_id(run_id)),
        "metrics_url": f"/api/v1/training_runs/{quote(run_id, safe='')}/metrics",
    }


@router.get("/sign_in")
async def sign_in(svc: Services = Depends(services)) -> dict:
    """What the sign-in page says about keys on this server, asked before there is a key: whether keys are
    configured (a 401 says as much to anyone), never how many or which."""
    return {"api_keys_configured": bool(svc.api_keys), "tenant_mode": tenant_mode(bool(svc.api_keys))}


@router.get("/service")
async def service(svc: Services = Depends(services), _: str = Depends(owner)) -> dict:
    """Per served base model (one Coordinator each): its workers and their adapter slots, and its sampling queue;
    per JAX worker whose /metrics the API reads (worker_metrics): tokens/s, MFU and device memory. Counts only:
    which adapters sit in the slots (other tenants' run ids) is not shown."""
    models = []
    query = "WorkflowType = 'Coordinator' AND ExecutionStatus = 'Running'"
    async for wf in svc.client.list_workflows(query):
        try:
            d: dict[str, Any] = await svc.client.get_workflow_handle(wf.id).query("describe")
        except Exception as e:
            log.debug("console: coordinator %s not described: %s", wf.id, e)
            models.append({"coordinator": wf.id, "answered": False})
            continue
        workers = [
            {
                "worker_id": w.get("worker_id", q),
                "slots_used": int(w.get("slots_used", 0)),
                "slots_total": int(w.get("max_adapters", 0)),
                "runs_live": int(w.get("runs_live", w.get("slots_used", 0))),
                "runs_max": int(w.get("max_adapters", 0)) + int(w.get("max_paged", 0)),
                "busy": bool(w.get("busy", False)),
            }
            for q, w in sorted(d.get("workers", {}).items())
        ]
        models.append(
            {
                "coordinator": wf.id,
                "answered": True,
                "base_model": d.get("base_model", ""),
                "pool": d.get("pool", ""),
                "workers": workers,
                "slots_used": sum(w["slots_used"] for w in workers),
                "slots_total": sum(w["slots_total"] for w in workers),
                # Slots as a cache: runs live on this base model, those paged out, page moves asked for.
                "runs_live": int(d.get("runs_live", sum(w["runs_live"] for w in workers))),
                "runs_paged": int(d.get("runs_paged", 0)),
                "page_ins": int(d.get("page_ins", 0)),
                "page_outs": int(d.get("page_outs", 0)),
                "queued_samples": int(d.get("pending_samples", 0)),
                "queued_sample_tokens": int(d.get("pending_sample_tokens", 0)),
                "queued_work_items": int(d.get("pending", 0)),
                "dispatched_batches": int(d.get("dispatched_batches", 0)),
                "temporal_ui_url": temporal_ui_link(svc, wf.id),
            }
        )
    workers = await svc.worker_metrics.read() if svc.worker_metrics else []
    return {"models": models, "engines": workers}
