"""HTTP errors with a body, always: the SDK retries an empty 400 as if a proxy had eaten it (docs/wire-contract.md
§Errors and retries).

The one mapping from errors to HTTP: built from the taxonomy in `tinkerflow.common.errors` (each exception type and
each Temporal ApplicationError type states its category and status there); nothing here holds a table of its own.
"""

from __future__ import annotations

from fastapi import HTTPException
from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from tinkerflow.common.errors import Category, TinkerflowError, classify_type


def http_error(status: int, detail: str) -> HTTPException:
    return HTTPException(status_code=status, detail=detail)


def from_error(e: TinkerflowError) -> HTTPException:
    """A taxonomy exception as the status its type states, its message as the detail."""
    return http_error(e.http_status, str(e))


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
        known = classify_type(cause.type) if isinstance(cause, ApplicationError) else None
        # An update rejected for no stated reason is still the request's fault: its validator refused it.
        return http_error(known.http_status if known else 400, message)
    return http_error(503, f"Temporal could not serve the request on {what}: {e}")


def failure_category(e: WorkflowUpdateFailedError | WorkflowFailureError) -> Category:
    """What a future that failed this way reports to the SDK: `user` only for the types the taxonomy says so."""
    cause = e.cause
    known = classify_type(cause.type) if isinstance(cause, ApplicationError) else None
    return known.category if known else Category.SERVER
