"""retrieve_future: long-poll a future's outcome in Temporal, then answer `try_again` (docs/wire-contract.md §Futures).

The SDK re-polls immediately after `try_again`, so holding the poll (up to ~25 s, under the SDK's 45 s timeout)
is what keeps it from spinning. Results are proto for forward_backward/sample, JSON otherwise; JSON results carry
non-finite numbers as the strings "NaN"/"Infinity"/"-Infinity" (see json_wire), so every result is answerable.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError

from tinkerflow.api import request_ids
from tinkerflow.api.batch_results import workflow_result
from tinkerflow.api.caller import owner, services
from tinkerflow.api.http_errors import failure_category, from_error, http_error, is_not_found
from tinkerflow.api.json_wire import WireJSONResponse as JSONResponse
from tinkerflow.api.lookups import json_body
from tinkerflow.api.services import Services
from tinkerflow.common.store import StoreError
from tinkerflow.workflows.protocol.messages import Outcome

router = APIRouter(prefix="/api/v1")
log = logging.getLogger(__name__)


async def _outcome(svc: Services, ref) -> Outcome:
    if isinstance(ref, request_ids.DoneRef):
        return Outcome(json=ref.result)
    if isinstance(ref, request_ids.FailedRef):
        return Outcome.failed(ref.error, ref.category)
    if isinstance(ref, request_ids.UpdateRef):
        handle = svc.client.get_workflow_handle(ref.workflow_id, run_id=ref.run_id or None)
        return await handle.get_update_handle(
            ref.update_id, workflow_run_id=ref.run_id or None, result_type=Outcome
        ).result()
    if isinstance(ref, request_ids.BatchItemRef):
        return await svc.batch_results.outcome(ref.workflow_id, ref.index)  # one fetch per batch, however many poll
    return await workflow_result(svc.client, ref.workflow_id, Outcome)


@router.post("/retrieve_future")
async def retrieve_future(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> Response:
    request_id = (await json_body(request)).get("request_id", "")
    try:
        ref = request_ids.decode(request_id, svc.signing_key, who)  # another key's id: 404, as for an unknown one
    except request_ids.BadRequestId as e:
        raise from_error(e) from None
    try:
        outcome = await asyncio.wait_for(_outcome(svc, ref), timeout=svc.settings.long_poll_s)
    except TimeoutError:
        return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
    except (WorkflowUpdateFailedError, WorkflowFailureError) as e:
        cause = e.cause
        return JSONResponse(
            {"error": getattr(cause, "message", None) or str(cause or e), "category": str(failure_category(e))}
        )
    except Exception as e:
        if is_not_found(e):
            raise http_error(404, f"unknown request_id {request_id[:80]!r}") from None
        log.warning("retrieve_future %s: %s", request_id, e)
        # Not a 5xx: the SDK re-polls 5xx instantly in a loop (docs/wire-contract.md §Futures); try_again costs it
        # nothing.
        return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
    if not outcome.ok:
        return JSONResponse({"error": outcome.error, "category": outcome.category or "unknown"})
    if outcome.blob is not None:
        try:
            data = await asyncio.to_thread(svc.store.get, outcome.blob)
        except StoreError as e:
            return JSONResponse({"error": str(e), "category": str(e.category)})
        return Response(content=data, media_type="application/x-protobuf")
    return JSONResponse(outcome.json or {})
