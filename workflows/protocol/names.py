"""Names a person sees in the Temporal UI and the code uses to find things: workflow ids, queues, attributes."""

from __future__ import annotations

from typing import Any

from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes

WORKFLOW_TASK_QUEUE = "tinkerflow-workflows"

SESSION_ID = SearchAttributeKey.for_keyword("TinkerflowSessionId")
BASE_MODEL = SearchAttributeKey.for_keyword("TinkerflowBaseModel")
STATUS = SearchAttributeKey.for_keyword("TinkerflowStatus")
STEP = SearchAttributeKey.for_int("TinkerflowStep")
# Who owns a session or run (the API key's hash; "open" when the API takes any key): the REST listings filter on it.
OWNER = SearchAttributeKey.for_keyword("TinkerflowOwner")
SEARCH_ATTRIBUTES = (SESSION_ID, BASE_MODEL, STATUS, STEP, OWNER)


def search_attributes(*pairs: tuple[SearchAttributeKey[Any], Any]) -> TypedSearchAttributes:
    """Search attributes a workflow starts with, e.g. search_attributes((SESSION_ID, "sess-1"))."""
    return TypedSearchAttributes([SearchAttributePair(key, value) for key, value in pairs])


def owner_value(owner: str) -> str:
    return owner or "open"


def checkpoint_expiry_workflow_id(tinker_path: str) -> str:
    return "checkpoint-expiry/" + tinker_path.removeprefix("tinker://")


def session_workflow_id(session_id: str) -> str:
    return f"session/{session_id}"


def run_workflow_id(model_id: str) -> str:
    return f"training-run/{model_id}"


def coordinator_workflow_id(base_model: str, pool: str) -> str:
    return f"coordinator/{base_model}/{pool}"


def sample_workflow_id(sampler_id: str, batch_id: str) -> str:
    return f"sample/{sampler_id}/{batch_id}"


def model_id_for(session_id: str, model_seq_id: int) -> str:
    # The SDK derives this itself for create-via-load, so it is not ours to choose (docs/wire-contract.md §Ids and
    # paths).
    return f"{session_id}:train:{model_seq_id}"


def sampler_id_for(session_id: str, seq: int) -> str:
    return f"{session_id}:sample:{seq}"


def inflight_key(model_id: str) -> str:
    """The snapshot key every inflight sampler of a training run reads: each inflight save re-takes it."""
    return f"{model_id}:inflight"


def session_of(model_or_sampler_id: str) -> str:
    return model_or_sampler_id.split(":", 1)[0]


def worker_task_queue(base_model: str, pool: str, worker_id: str) -> str:
    return f"jax/{pool}/{worker_id}"
