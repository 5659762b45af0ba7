"""HTTP errors with a body, always: the SDK retries an empty 400 as if a proxy had eaten it (contract §5.1)."""

from __future__ import annotations

from fastapi import HTTPException
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode


def http_error(status: int, detail: str) -> HTTPException:
    return HTTPException(status_code=status, detail=detail)


def is_not_found(e: Exception) -> bool:
    return isinstance(e, RPCError) and e.status == RPCStatusCode.NOT_FOUND


def from_temporal(e: Exception, what: str) -> HTTPException:
    """Map a Temporal failure on `what` (e.g. "training run x") to the status the contract implies."""
    if is_not_found(e):
        return http_error(404, f"{what} does not exist or has ended")
    if isinstance(e, RPCError) and e.status == RPCStatusCode.INVALID_ARGUMENT:
        return http_error(400, f"invalid request on {what}: {e.message}")
    if isinstance(e, WorkflowUpdateFailedError):
        cause = e.cause
        message = getattr(cause, "message", None) or str(cause or e)
        if isinstance(cause, ApplicationError) and cause.type == "SeqConflict":
            return http_error(409, message)
        if isinstance(cause, ApplicationError) and cause.type == "NotOwner":
            return http_error(404, message)
        return http_error(400, message)
    return http_error(503, f"Temporal could not serve the request on {what}: {e}")
