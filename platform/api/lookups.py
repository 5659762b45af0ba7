"""What several routes look up before acting: the JSON body, and a run, session or checkpoint that must be the
caller's."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from starlette.requests import ClientDisconnect

from tinkerflow.api.http_errors import from_error, from_temporal, http_error
from tinkerflow.api.identifiers import check_model_id, check_session_id
from tinkerflow.api.services import Services
from tinkerflow.common.checkpoints import CheckpointError, Manifest
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import RunState, SessionState
from tinkerflow.workflows.session import SessionWorkflow
from tinkerflow.workflows.training_run import TrainingRunWorkflow

# nginx's "client closed request": nobody reads the answer, but the route ends as an answer, not an ASGI error.
CLIENT_CLOSED = 499


async def json_body(request: Request) -> dict:
    try:  # a body over its route's limit is a 413 (body_limits), not a 400: raised through, not caught here
        raw = await request.body()
    except ClientDisconnect:  # an SDK that ended (a recipe done) while its long poll's body was on the way
        raise http_error(CLIENT_CLOSED, "the client closed the request before its body arrived") from None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: too deep (json_depth.py refuses those first, with 400)
        raise http_error(400, "request body is not valid JSON (or is nested too deeply)") from None
    if not isinstance(body, dict):
        raise http_error(400, "request body must be a JSON object")
    return body


async def run_of_caller(svc: Services, model_id: str, who: str) -> RunState:
    """The run's state, or 404 when it does not exist or belongs to another tenant (the same answer for both)."""
    check_model_id(model_id)
    try:
        state = await svc.client.get_workflow_handle(names.run_workflow_id(model_id)).query(
            TrainingRunWorkflow.describe
        )
    except Exception as e:
        raise from_temporal(e, f"training run {model_id!r}") from None
    if state.start.owner != who:
        raise http_error(404, f"training run {model_id!r} does not exist or has ended")
    return state


async def checkpoint_of_caller(svc: Services, path: str, who: str) -> Manifest:
    """A checkpoint's manifest, or 404 when it does not exist, expired or is another tenant's private one; 400 when
    the path is malformed."""
    try:
        return await asyncio.to_thread(svc.checkpoints.readable, path, who)
    except CheckpointError as e:  # CheckpointNotFound: 404, the rest 400 (the taxonomy says which)
        raise from_error(e) from None


async def session_of_caller(svc: Services, session_id: str, who: str) -> SessionState:
    """The session's state, or 404 when it does not exist or belongs to another tenant."""
    check_session_id(session_id)
    try:
        state = await svc.client.get_workflow_handle(names.session_workflow_id(session_id)).query(
            SessionWorkflow.describe
        )
    except Exception as e:
        raise from_temporal(e, f"session {session_id!r}") from None
    if state.owner != who:
        raise http_error(404, f"session {session_id!r} does not exist or has ended")
    return state
