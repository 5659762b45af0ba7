"""How a training route hands an op to its run: the body hash that tells a retry from a reused seq_id, the `reject`
op that consumes a seq_id whose body is bad (or whose key is past a quota), and the Update that carries the op
(routes_training.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from temporalio.client import WorkflowUpdateStage

from tinkerflow.api import request_ids
from tinkerflow.api.http_errors import from_temporal, http_error
from tinkerflow.api.identifiers import check_model_id
from tinkerflow.api.services import Services
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import OpKind, TrainingOp
from tinkerflow.workflows.training_run import TrainingRunWorkflow


def hash_body(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def request_id(svc: Services, ref, who: str) -> str:
    return request_ids.encode(ref, svc.signing_key, who)


def check_model_seq_id(model_seq_id: int | None) -> None:
    if model_seq_id is not None and not 0 <= model_seq_id < 2**31:
        raise http_error(400, f"model_seq_id must be an integer in 0 .. 2**31-1, got {model_seq_id}")


def reject(seq_id: int, raw: dict[str, Any], message: str) -> TrainingOp:
    return TrainingOp(seq_id=seq_id, kind=OpKind.REJECT, body_hash=hash_body(canonical(raw)), error=message)


async def submit(svc: Services, model_id: str, op: TrainingOp, who: str) -> dict:
    # The run's update validator checks the owner: no extra round trip per op for tenant isolation.
    check_model_id(model_id)  # a workflow id: checked before use (a malformed one cannot name a run anyway)
    op = dataclasses.replace(op, owner=who)
    handle = svc.client.get_workflow_handle(names.run_workflow_id(model_id))
    try:
        update = await handle.start_update(
            TrainingRunWorkflow.op,
            op,
            id=f"seq-{op.seq_id}-{op.body_hash[:16]}",
            wait_for_stage=WorkflowUpdateStage.ACCEPTED,
        )
        # A validator rejection does not raise here: the handle comes back with its failure already known
        # (temporalio keeps it in `_known_outcome`). Surface it now, as the HTTP error it is (409 for a reused seq_id).
        known = getattr(update, "_known_outcome", None)
        if known is not None and known.HasField("failure"):
            await update.result()
    except Exception as e:
        raise from_temporal(e, f"training run {model_id!r}") from None
    rid = request_id(svc, request_ids.UpdateRef(update.workflow_id, update.workflow_run_id or "", update.id), who)
    return {"request_id": rid, "model_id": model_id}


async def submit_save(svc: Services, model_id: str, op: TrainingOp, who: str, raw: dict[str, Any]) -> dict:
    """A named save past the key's stored_gb quota fails its own future, in sequence like every op with a seq_id."""
    if op.kind is not OpKind.REJECT and op.save is not None and op.save.path:
        refusal = await svc.quotas.storage_refusal(svc, who)
        if refusal is not None:
            op = reject(op.seq_id, raw, f"{op.kind}: {refusal.message}")
    return await submit(svc, model_id, op, who)
