"""Checks on request bodies that the routes share, written so an in-sequence op never fails at submit
(docs/architecture.md §What durability promises).

An op carrying a `seq_id` must take its place in its run's sequence even when its body is wrong: a submit-time
400 leaves that seq_id unconsumed and every later op of the same TrainingClient waits for it forever. So the
in-sequence routes read only `model_id` and `seq_id` strictly (without them there is no sequence to keep), and turn
every other problem into a message that the route submits as a `reject` op, which fails that op's own future with
a `user` error naming the field.
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tinkerflow.api.http_errors import http_error

M = TypeVar("M", bound=BaseModel)

# user_metadata is stored into workflow history (RunStart, manifests): keep it to what a person writes by hand.
MAX_USER_METADATA_BYTES = 16 * 1024
# Ids this server hands out are far shorter; Temporal refuses workflow ids over 1,000 characters.
MAX_ID_CHARS = 256


def sequence_key(raw: dict[str, Any], op: str) -> tuple[str, int]:
    """(model_id, seq_id) of an in-sequence request; a 400 only when there is no sequence to admit it into."""
    model_id, seq_id = raw.get("model_id"), raw.get("seq_id", 0)
    if not isinstance(model_id, str) or not model_id or len(model_id) > MAX_ID_CHARS:
        raise http_error(400, f"{op}: model_id must be a non-empty string of at most {MAX_ID_CHARS} characters")
    if seq_id is None:  # the SDK's models allow it; it means the run's first op
        seq_id = 0
    if isinstance(seq_id, bool) or not isinstance(seq_id, int) or not 0 <= seq_id < 2**63:
        raise http_error(400, f"{op}: seq_id must be an integer >= 0, got {seq_id!r}")
    return model_id, seq_id


def parse(model: type[M], raw: dict[str, Any], op: str) -> tuple[M | None, str]:
    """The SDK model of `raw`, or None and a message naming every bad field (for a `reject` op)."""
    try:
        return model.model_validate(raw), ""
    except ValidationError as e:
        return None, f"{op}: {describe(e)}"


def describe(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        got = err.get("input")
        note = " (the SDK sends NaN and infinity as null)" if got is None else ""
        parts.append(f"{where}: {err.get('msg', 'invalid')}{note}")
    return "; ".join(parts)


def adam_problem(p: Any) -> str:
    """What is wrong with AdamParams, in the ranges torch.optim.AdamW accepts ("" when nothing).

    torch refuses lr < 0, eps < 0, betas outside [0, 1) and weight_decay < 0; Tinker's grad_clip_norm 0 means no
    clipping, so a negative one is a mistake too. Everything must be finite: one NaN hyper-parameter makes the
    adapter's weights NaN for good."""
    values = {
        "learning_rate": p.learning_rate,
        "beta1": p.beta1,
        "beta2": p.beta2,
        "eps": p.eps,
        "weight_decay": p.weight_decay,
        "grad_clip_norm": p.grad_clip_norm,
    }
    for name, v in values.items():
        if not math.isfinite(v):
            return f"adam_params.{name} must be finite, got {v}"
    for name in ("learning_rate", "eps", "weight_decay", "grad_clip_norm"):
        if values[name] < 0:
            return f"adam_params.{name} must be >= 0, got {values[name]}"
    for name in ("beta1", "beta2"):
        if not 0 <= values[name] < 1:
            return f"adam_params.{name} must be in [0, 1), got {values[name]}"
    return ""


def metadata_problem(metadata: Any, field: str = "user_metadata") -> str:
    """user_metadata must be a JSON object of at most MAX_USER_METADATA_BYTES ("" when it is)."""
    if metadata is None:
        return ""
    if not isinstance(metadata, dict):
        return f"{field} must be a JSON object"
    try:
        size = len(json.dumps(metadata, allow_nan=False).encode())
    except (ValueError, TypeError, RecursionError) as e:
        return f"{field} is not plain JSON: {e}"
    if size > MAX_USER_METADATA_BYTES:
        return f"{field} is {size:,} bytes of JSON, over the limit of {MAX_USER_METADATA_BYTES:,}"
    return ""


def check_metadata(metadata: Any, field: str = "user_metadata") -> None:
    """For routes outside a sequence: 400 naming the field."""
    problem = metadata_problem(metadata, field)
    if problem:
        raise http_error(400, problem)
