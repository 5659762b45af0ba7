"""Ids and paths a caller sends, checked before anything uses them (docs/security.md §Names and paths).

Each becomes part of a Temporal workflow id, a visibility query, a file-system path or a glob, so each is checked
for length, characters and shape first: a 400 with a message, never a 5xx, a reset connection, a glob of every run
or a query with a quote in it. Checkpoint names and tinker:// paths are checked in `tinkerflow.common.checkpoints`
(the worker checks them too); this module turns those checks into HTTP answers and adds the ids only the API sees.
"""

from __future__ import annotations

import re

from tinkerflow.api.http_errors import from_error, http_error
from tinkerflow.common.checkpoints import CheckpointError, TinkerPath, check_run

MAX_SESSION_CHARS = 64
# What create_session mints (sess-<hex>) and copy_weights' runs use (copy-<hex>): a word, no ':' '/' '*' or quote.
_SESSION = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_-]{{0,{MAX_SESSION_CHARS - 1}}}")
_SAMPLER = re.compile(rf"({_SESSION.pattern}):sample:\d{{1,9}}")
MAX_PROJECT_CHARS = 256


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_session_id(session_id: object) -> str:
    if not isinstance(session_id, str) or not _SESSION.fullmatch(session_id):
        raise http_error(
            400,
            f"session_id {_shown(session_id)} is malformed: use the id create_session returned "
            f"(letters, digits, '-' and '_', at most {MAX_SESSION_CHARS})",
        )
    return session_id


def check_model_id(model_id: object, field: str = "model_id") -> str:
    """A training run id (== model_id, == the first part of its tinker:// paths)."""
    if not model_id:
        raise http_error(400, f"{field} is required")
    try:
        check_run(model_id)  # type: ignore[arg-type]
    except CheckpointError as e:
        raise http_error(400, f"{field}: {e}") from None
    return model_id  # type: ignore[return-value]


def check_sampler_id(sampler_id: object) -> str:
    if not isinstance(sampler_id, str) or not _SAMPLER.fullmatch(sampler_id):
        raise http_error(
            400,
            f"sampling_session_id {_shown(sampler_id)} is malformed: use the id "
            "create_sampling_session returned (<session_id>:sample:<n>)",
        )
    return sampler_id


def tinker_path(path: object, field: str = "tinker_path") -> TinkerPath:
    try:
        return TinkerPath.parse(path)  # type: ignore[arg-type]
    except CheckpointError as e:
        raise http_error(400, f"{field}: {e}") from None


def checkpoint_path(run: str, checkpoint_id: str) -> TinkerPath:
    """`tinker://<run>/<checkpoint_id>` from a route's path parameters."""
    try:
        return TinkerPath.from_checkpoint_id(run, checkpoint_id)
    except CheckpointError as e:
        raise from_error(e) from None


def check_project_id(project_id: object) -> str:
    if not isinstance(project_id, str) or not project_id or len(project_id) > MAX_PROJECT_CHARS:
        raise http_error(400, f"project_id must be a string of 1 to {MAX_PROJECT_CHARS} characters")
    return project_id
