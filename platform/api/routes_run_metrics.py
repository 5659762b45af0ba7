"""`GET /api/v1/training_runs/{run}/metrics`: a run's recorded metric points, oldest first, in pages.

Same key and tenancy as `GET /api/v1/training_runs/{run}`: another tenant's run and an unknown run both answer 404
with the same body. The points come from the store (tinkerflow.common.run_metrics), where the JAX worker recorded
them, so they outlive a restart of the API, the workers or the run's workflow. Page with `after` = the last index
seen (`next_after` of the previous page).
"""

from __future__ import annotations

import asyncio
import functools

from fastapi import APIRouter, Depends, Query

from tinkerflow.api.caller import owner, services
from tinkerflow.api.lookups import run_of_caller
from tinkerflow.api.services import Services
from tinkerflow.common.run_metrics import RunMetricsStore

router = APIRouter(prefix="/api/v1")
MAX_LIMIT = 5000


@functools.cache
def _points_store(url: str) -> RunMetricsStore:
    return RunMetricsStore(url)


@router.get("/training_runs/{run}/metrics")
async def run_metrics(
    run: str,
    after: int = Query(-1, ge=-1, description="answer points with an index above this (the last index seen)"),
    limit: int = Query(1000, ge=1, le=MAX_LIMIT, description="most points in one answer"),
    svc: Services = Depends(services),
    who: str = Depends(owner),
) -> dict:
    state = await run_of_caller(svc, run, who)  # 404 for a stranger's run as for none at all
    model_id = state.start.model_id
    page = await asyncio.to_thread(_points_store(svc.store.url).page, model_id, after, limit)
    return {
        "training_run_id": model_id,
        "points": [p.as_json() for p in page.points],
        "next_after": page.next_after,
        "total_points": page.total_points,
    }
