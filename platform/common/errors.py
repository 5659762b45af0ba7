"""One error taxonomy: every error tinkerflow raises on purpose, with its category and the HTTP status it implies.

platform/common, under the API, the activities and the engine, owns it so all three raise the same types. Two families:

- exceptions (`TinkerflowError` and below), raised in-process: the engine's bad input, a malformed or unknown
  checkpoint path, a forged request id, an unreachable claim-check store, an unknown base model;
- Temporal `ApplicationError` types (`ErrorType`, which lives in `workflows/protocol/` because workflow code may import
  only workflows/), raised by workflows and activities; `TEMPORAL_ERRORS` gives each its category and status.

`category` is what a failed future reports to the SDK (docs/wire-contract.md §Futures: "user" or "server");
`http_status` is what a synchronous route answers (docs/wire-contract.md §Errors and retries: the SDK retries
408/409/429/5xx, and treats 400/404 as final). `tinkerflow.api.http_errors` turns both families into HTTP responses; it
holds no table of its own."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from tinkerflow.workflows.protocol.error_types import ErrorType


class Category(StrEnum):
    USER = "user"  # the request is wrong: retrying it unchanged fails again
    SERVER = "server"  # the service failed: the same request may succeed later


class TinkerflowError(Exception):
    """Base of the taxonomy. A subclass states its category and HTTP status once, as class attributes."""

    category: ClassVar[Category] = Category.SERVER
    http_status: ClassVar[int] = 500


class UserError(TinkerflowError, ValueError):
    """Something the caller sent is wrong; the message says what and how to fix it (a ValueError, as before)."""

    category = Category.USER
    http_status = 400


class InputError(UserError):
    """A problem with what the user sent to the engine (bad token id, wrong shape, unknown loss...).

    Reported to the SDK as a failed future with category `user`; it never touches adapter state.
    """


class CustomLossError(InputError):
    """A server-side custom loss this server refuses, when it is created or when it runs; the message names the node
    and the op (tinkerflow.common.custom_loss_graph)."""


class UnknownModelError(UserError):
    """A base model that is neither in the local HF cache nor a Hugging Face model directory."""


class CheckpointError(UserError):
    """A user-facing problem with a checkpoint path or request (the message says what to do)."""


class CheckpointNotFound(CheckpointError):
    """A checkpoint that does not exist, expired, or is another tenant's private one (the same answer for all)."""

    http_status = 404


class BadRequestId(UserError):
    """A request_id that does not decode or belongs to another key: 404, as for an unknown one."""

    http_status = 404


class StoreError(TinkerflowError, RuntimeError):
    """The claim-check store could not be read or written; a later retry may succeed."""

    category = Category.SERVER
    http_status = 503


@dataclass(frozen=True)
class Classification:
    category: Category
    http_status: int


# Every ApplicationError type: what a failed future reports, and what an update rejected with it answers over HTTP.
TEMPORAL_ERRORS: dict[ErrorType, Classification] = {
    ErrorType.SEQ_CONFLICT: Classification(Category.USER, 409),
    ErrorType.SEQ_TOO_FAR: Classification(Category.USER, 400),
    ErrorType.NOT_OWNER: Classification(Category.USER, 404),  # the same answer as for a run that does not exist
    ErrorType.RUN_CLOSED: Classification(Category.USER, 400),
    ErrorType.SESSION_ENDED: Classification(Category.USER, 400),
    ErrorType.UNKNOWN_SAMPLER: Classification(Category.USER, 400),
    ErrorType.ADAPTER_LOST: Classification(Category.SERVER, 503),
    ErrorType.WORKER_LOST: Classification(Category.SERVER, 503),
}


def classify_type(error_type: str | None) -> Classification | None:
    """The taxonomy's entry for an ApplicationError's `type` (None: a type raised on no purpose, e.g. a bug)."""
    try:
        return TEMPORAL_ERRORS[ErrorType(error_type)] if error_type else None
    except ValueError:
        return None
