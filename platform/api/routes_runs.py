"""Training runs and sessions of the RestClient (contract §3.11): found through Temporal visibility, read by query.

Every session and run workflow carries the `TinkerflowOwner` search attribute, so a listing is one visibility query
for the caller's own workflows; the details come from each workflow's `describe` query (which also answers for
closed workflows). Checkpoint facts come from the checkpoint root, where they are true.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Query

from tinkerflow.api.deps import owner, services
from tinkerflow.api.errors import from_temporal
from tinkerflow.api.lookups import run_of_caller, session_of_caller
from tinkerflow.api.services import Services
from tinkerflow.common.checkpoints import TinkerPath
from tinkerflow.workflows import names
from tinkerflow.workflows.messages import RunState
from tinkerflow.workflows.training_run import TrainingRunWorkflow

router = APIRouter(prefix="/api/v1")


def _owned_query(workflow_type: str, who: str) -> str:
    # Continue-as-new leaves one closed execution per run behind; only the latest one is the session or run.
    return (f"WorkflowType = '{workflow_type}' AND {names.OWNER.name} = '{names.owner_value(who)}' "
            "AND ExecutionStatus != 'ContinuedAsNew'")


async def _ids(svc: Services, workflow_type: str, who: str, prefix: str) -> list[str]:
    ids: list[str] = []
    async for wf in svc.client.list_workflows(_owned_query(workflow_type, who)):
        if wf.id.startswith(prefix) and wf.id[len(prefix):] not in ids:
            ids.append(wf.id[len(prefix):])
    return ids  # newest first: visibility orders by start time


async def _checkpoint(svc: Services, path: str) -> dict[str, Any] | None:
    if not path:
        return None
    m = await asyncio.to_thread(svc.checkpoints.manifest, TinkerPath.parse(path))
    return m.as_checkpoint() if m is not None else None


async def _training_run(svc: Services, state: RunState) -> dict[str, Any]:
    start = state.start
    return {
        "training_run_id": start.model_id, "base_model": start.base_model, "model_owner": start.owner or "open",
        "is_lora": True, "corrupted": state.status == "failed", "lora_rank": state.lora_spec.rank,
        "last_request_time": state.last_request_time or "1970-01-01T00:00:00Z",
        "last_checkpoint": await _checkpoint(svc, state.last_checkpoint),
        "last_sampler_checkpoint": await _checkpoint(svc, state.last_sampler_checkpoint),
        "user_metadata": {str(k): str(v) for k, v in start.user_metadata.items()},
    }


@router.get("/training_runs")
async def list_training_runs(limit: int = Query(20, ge=1, le=1000), offset: int = Query(0, ge=0),
                             svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    ids = await _ids(svc, "TrainingRun", who, "training-run/")
    page = ids[offset:offset + limit]
    runs = []
    for model_id in page:
        try:
            state = await svc.client.get_workflow_handle(names.run_workflow_id(model_id)).query(
                TrainingRunWorkflow.describe)
        except Exception as e:
            raise from_temporal(e, f"training run {model_id}") from None
        runs.append(await _training_run(svc, state))
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": len(ids)}}


@router.get("/training_runs/{run}")
async def get_training_run(run: str, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    return await _training_run(svc, await run_of_caller(svc, run, who))


@router.get("/sessions")
async def list_sessions(limit: int = Query(20, ge=1, le=1000), offset: int = Query(0, ge=0),
                        svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    ids = await _ids(svc, "Session", who, "session/")
    return {"sessions": ids[offset:offset + limit]}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    s = await session_of_caller(svc, session_id, who)
    return {"training_run_ids": list(s.training_run_ids), "sampler_ids": sorted(s.samplers),
            "user_metadata": {str(k): str(v) for k, v in s.user_metadata.items()} or None}
