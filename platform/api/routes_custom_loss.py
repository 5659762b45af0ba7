"""create_custom_loss: the SDK's traced per-datum loss, checked against the allow-list; its loss_id is the checked
loss itself, signed for the caller and the session (tinkerflow.common.custom_loss_graph, docs/custom-losses.md).

The SDK sends it once /client/config turns `custom_loss_server_side` on, and treats the answer as a future: a graph
the check refuses fails that future with a `user` error naming the node and the op; a body that is not a
CreateCustomLossRequest is a 400. forward_backward's side (loss_fn "custom") is `custom_loss_problem`: the loss_id
must be one this server gave the same key in the run's own session, else the op fails as an unknown loss."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from google.protobuf.message import DecodeError
from pydantic import ValidationError
from tinker.proto import tinker_public_pb2 as pb
from tinker.types import CreateCustomLossRequest

from tinkerflow.api import request_ids
from tinkerflow.api.caller import owner, services
from tinkerflow.api.http_errors import http_error
from tinkerflow.api.lookups import json_body, session_of_caller
from tinkerflow.api.op_checks import describe
from tinkerflow.api.protobuf_header import ForwardBackwardHeader
from tinkerflow.api.services import Services
from tinkerflow.common import custom_loss_graph
from tinkerflow.workflows.protocol import names

router = APIRouter(prefix="/api/v1")


@router.post("/create_custom_loss")
async def create_custom_loss(request: Request, svc: Services = Depends(services), who: str = Depends(owner)) -> dict:
    try:
        req = CreateCustomLossRequest.model_validate(await json_body(request))
    except ValidationError as e:
        raise http_error(400, f"create_custom_loss: {describe(e)}") from None
    await session_of_caller(svc, req.session_id, who)  # another tenant's session: 404
    try:
        checked = custom_loss_graph.check(
            req.name, [i.model_dump() for i in req.inputs], [n.model_dump() for n in req.graph.nodes]
        )
    except custom_loss_graph.CustomLossError as e:
        ref: request_ids.FailedRef | request_ids.DoneRef = request_ids.FailedRef(str(e))
    else:
        loss_id = custom_loss_graph.loss_id(checked, req.session_id, svc.signing_key, who)
        ref = request_ids.DoneRef({"loss_id": loss_id, "type": "create_custom_loss"})
    return {"request_id": request_ids.encode(ref, svc.signing_key, who)}


def custom_loss_problem(svc: Services, header: ForwardBackwardHeader, who: str) -> str:
    """What is wrong with a forward_backward whose loss_fn is "custom" ("" when nothing), from its loss fields."""
    msg = pb.ForwardBackwardRequest.FromString(header.loss_fields)
    config = {k: v for k, v in msg.loss_fn_config_v2.items()}
    value = config.get("loss_id")
    if value is None or value.WhichOneof("value") != "text":
        return "loss_fn 'custom' needs loss_fn_config['loss_id'] from ServiceClient.create_custom_loss"
    extra = sorted(set(config) - {"loss_id"} | set(msg.loss_fn_config) - {"loss_id"})
    if extra:
        return f"loss_fn 'custom' takes loss_fn_config {{'loss_id'}} only, got also {extra}"
    if not custom_loss_graph.verify(value.text, names.session_of(header.model_id), svc.signing_key, who):
        # Another tenant's, another session's or a made-up id: the same answer, naming none of them.
        return "unknown loss_id: create the loss with this session's ServiceClient.create_custom_loss"
    return ""


def is_custom(header: ForwardBackwardHeader) -> bool:
    """Whether the op names loss_fn "custom"; loss fields that do not decode are the worker's to report."""
    try:
        return pb.ForwardBackwardRequest.FromString(header.loss_fields).loss_fn == "custom"
    except DecodeError:
        return False
