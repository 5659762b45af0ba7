"""`request_id`s name where a future's outcome lives in Temporal (docs/architecture.md §The life of one op, §Temporal
facts that shape the code).

An update's outcome is addressed by workflow id + run id + update id (update ids are per run, and continue-as-new
starts a new run); a request workflow's outcome by its workflow id. Both are encoded in the id itself, so no
process has to remember anything to answer a poll.

Each id also carries an HMAC (the server's signing key, `--url-signing-key`) over the encoding and the owner of the
key that created it: only that key's polls resolve it, on any replica sharing the key and after restarts. Another
tenant's id, or one built by hand from a model_id (workflow ids are not secret), is `BadRequestId`: the same 404 as
an id that never existed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from dataclasses import dataclass, field

from tinkerflow.common.errors import BadRequestId


@dataclass(frozen=True)
class UpdateRef:
    workflow_id: str
    run_id: str
    update_id: str


@dataclass(frozen=True)
class WorkflowRef:
    workflow_id: str


@dataclass(frozen=True)
class BatchItemRef:
    """Item `index` of the list a (sample batch) workflow returns."""

    workflow_id: str
    index: int
    payload_uri: str = field(default="", compare=False)  # where its body is, when known (never in the id)


@dataclass(frozen=True)
class FailedRef:
    """A future that failed before anything was started (e.g. create-via-load of a checkpoint that does not exist):
    the error travels in the id itself, so any API process answers it the same way."""

    error: str
    category: str = "user"
    # What tells apart two calls that failed with the same message (a sampling call's sampler and seq_id): the SDK's
    # retrieve_futures poll keys futures by request id, and acking one would retire the other's record with it.
    call: str = ""


@dataclass(frozen=True)
class DoneRef:
    """A future answered at submit (create_custom_loss: its loss_id): the JSON result travels in the id itself."""

    result: dict


def _b64(data: str) -> str:
    return base64.urlsafe_b64encode(data.encode()).decode().rstrip("=")


def _unb64(data: str) -> str:
    return base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)).decode()


_SIGNATURE_BYTES = 16  # 128 bits: unforgeable, and short enough for a header


def _signature(key: bytes, owner: str, body: str) -> str:
    mac = hmac.new(key, f"request-id\n{owner}\n{body}".encode(), hashlib.sha256).digest()[:_SIGNATURE_BYTES]
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def encode(ref: UpdateRef | WorkflowRef | BatchItemRef | FailedRef | DoneRef, key: bytes, owner: str) -> str:
    """The request_id for `ref`, answerable only to `owner` (the caller's owner id, "" when the API is open)."""
    body = _encode(ref)
    return f"{body}.{_signature(key, owner, body)}"


def decode(request_id: str, key: bytes, owner: str) -> UpdateRef | WorkflowRef | BatchItemRef | FailedRef | DoneRef:
    """The ref of an id `owner` was given; BadRequestId for anything else (garbage, forged, another owner's)."""
    body, _, signature = request_id.rpartition(".") if isinstance(request_id, str) else ("", "", "")
    if not body or not hmac.compare_digest(signature.encode(), _signature(key, owner, body).encode()):
        raise BadRequestId(f"unknown request_id {_shown(request_id)}")
    return _decode(body)


def _shown(request_id: object) -> str:
    return repr(request_id)[:80]


def _encode(ref: UpdateRef | WorkflowRef | BatchItemRef | FailedRef | DoneRef) -> str:
    if isinstance(ref, DoneRef):
        return "d." + _b64(json.dumps(ref.result))
    if isinstance(ref, FailedRef):
        return "f." + _b64(json.dumps([ref.error, ref.category, *([ref.call] if ref.call else [])]))
    if isinstance(ref, UpdateRef):
        return "u." + _b64(json.dumps([ref.workflow_id, ref.run_id, ref.update_id]))
    if isinstance(ref, BatchItemRef):
        return "b." + _b64(json.dumps([ref.workflow_id, ref.index]))
    return "w." + _b64(ref.workflow_id)


def _decode(request_id: str) -> UpdateRef | WorkflowRef | BatchItemRef | FailedRef | DoneRef:
    try:
        kind, _, payload = request_id.partition(".")
        if kind == "d":
            return DoneRef(dict(json.loads(_unb64(payload))))
        if kind == "u":
            wf, run, upd = json.loads(_unb64(payload))
            return UpdateRef(str(wf), str(run), str(upd))
        if kind == "w":
            return WorkflowRef(_unb64(payload))
        if kind == "f":
            error, category, *call = json.loads(_unb64(payload))
            return FailedRef(str(error), str(category), str(call[0]) if call else "")
        if kind == "b":
            wf, index = json.loads(_unb64(payload))
            return BatchItemRef(str(wf), int(index))
    except Exception:
        pass
    raise BadRequestId(f"unknown request_id {_shown(request_id)}")
