"""The `type` of every ApplicationError the workflows and activities raise on purpose.

Workflow code may import only the standard library, temporalio and itself, so the names live here; the API's HTTP
mapping and each type's category (`tinkerflow.common.errors`) are built from this enum. The values are what Temporal
records in history and hands to clients: never rename one (a renamed value is a different error to a running
client and to replay).
"""

from __future__ import annotations

from enum import StrEnum


class ErrorType(StrEnum):
    SEQ_CONFLICT = "SeqConflict"  # a seq_id reused for a different request (or older than the answers kept)
    SEQ_TOO_FAR = "SeqTooFar"  # a seq_id so far ahead of the run's next that it would wait forever
    NOT_OWNER = "NotOwner"  # another tenant's run: answered like one that does not exist
    RUN_CLOSED = "RunClosed"  # the training run was closed (session ended, run released)
    SESSION_ENDED = "SessionEnded"  # the session timed out or was finished
    UNKNOWN_SAMPLER = "UnknownSampler"  # a sampling session this session never created
    ADAPTER_LOST = "AdapterLost"  # the adapter's slot was released or its JAX worker died
    WORKER_LOST = "WorkerLost"  # the batch was placed on an earlier process of a restarted JAX worker
