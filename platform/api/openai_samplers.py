"""Where the OpenAI-compatible routes get a sampler and a tokenizer for a `model`.

A sampler must belong to a session (the Coordinator's fairness is per session, and the Temporal UI shows who samples
what). The OpenAI API has no sessions, so each tenant gets ONE long-lived session, `openai-<owner>`, that the API
starts on first use with signal-with-start and keeps alive with heartbeats while it is used (at most one signal per
HEARTBEAT_EVERY_FRACTION of the session timeout per API process). Idle longer than the session timeout, it ends like
any session, and the next call starts it again under the same id. Its samplers have deterministic sequence numbers
(a hash of the model), so registering is idempotent across requests, API restarts and replicas: no session and no
sampler is ever created per request.

Sampling itself needs only the SamplerInfo (the Coordinator never asks the session), so a cached sampler keeps
working while the session is restarted; only registration needs the session running.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from tinkerflow.api.http_errors import from_temporal, is_not_found
from tinkerflow.api.services import Services
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import SamplerInfo, SamplerRequest, SessionStart
from tinkerflow.workflows.session import SessionWorkflow

log = logging.getLogger(__name__)
HEARTBEAT_EVERY_FRACTION = 0.25
# Sampler sequence numbers: 9 digits (identifiers._SAMPLER); probe the next one on the (unlikely) collision.
SEQ_SPACE = 10**9
MAX_PROBES = 8


def session_id_of(owner: str) -> str:
    """The tenant's OpenAI session id: a word (identifiers._SESSION), never one create_session mints (sess-...)."""
    return f"openai-{owner or 'open'}"


def seq_of(base_model: str, model_path: str, probe: int = 0) -> int:
    digest = hashlib.sha256(f"{base_model}\0{model_path}\0{probe}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % SEQ_SPACE


@dataclass
class OpenAISamplers:
    """Per API process: the tenants' samplers, their last heartbeat, and the tokenizers of the base models."""

    samplers: dict[tuple[str, str, str], SamplerInfo] = field(default_factory=dict)  # (owner, base, path)
    beaten_at: dict[str, float] = field(default_factory=dict)  # session id -> monotonic time of the last beat
    tokenizers: dict[str, Any] = field(default_factory=dict)
    _tokenizer_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def sampler(self, svc: Services, owner: str, base_model: str, model_path: str) -> SamplerInfo:
        session_id = session_id_of(owner)
        await self._heartbeat(svc, session_id, owner)
        key = (owner, base_model, model_path)
        cached = self.samplers.get(key)
        if cached is not None:
            return cached
        try:
            info = await self._register(svc, session_id, base_model, model_path)
        except Exception as e:
            # The session may have just timed out (a heartbeat racing its end is lost): start it again, once.
            if not (_session_ended(e) or is_not_found(e)):
                raise from_temporal(e, f"session {session_id}") from None
            log.info("openai session %s had ended; starting it again", session_id)
            await self._heartbeat(svc, session_id, owner, force=True)
            try:
                info = await self._register(svc, session_id, base_model, model_path)
            except Exception as e2:
                raise from_temporal(e2, f"session {session_id}") from None
        self.samplers[key] = info
        return info

    async def _register(self, svc: Services, session_id: str, base_model: str, model_path: str) -> SamplerInfo:
        handle = svc.client.get_workflow_handle(names.session_workflow_id(session_id))
        for probe in range(MAX_PROBES):
            seq = seq_of(base_model, model_path, probe)
            info = await handle.execute_update(
                SessionWorkflow.register_sampler,
                SamplerRequest(seq=seq, base_model=base_model, model_path=model_path, pool=svc.settings.pool),
                id=f"sampler-{seq}",
            )
            if (info.base_model, info.model_path) == (base_model, model_path):
                return info
        raise RuntimeError(f"no free sampler number for {model_path or base_model} in {session_id}")

    async def _heartbeat(self, svc: Services, session_id: str, owner: str, force: bool = False) -> None:
        timeout = svc.settings.session_timeout_s
        last = self.beaten_at.get(session_id)
        if not force and last is not None and time.monotonic() - last < timeout * HEARTBEAT_EVERY_FRACTION:
            return
        start = SessionStart(
            session_id=session_id,
            owner=owner,
            tags=["openai"],
            sdk_version="openai-compatible",
            heartbeat_timeout_s=timeout,
            display_name="OpenAI-compatible endpoint",
        )
        try:
            # Signal-with-start: signals the running session, or starts it (same id) when it is absent or ended.
            await svc.client.start_workflow(
                SessionWorkflow.run,
                args=[start, None],
                id=names.session_workflow_id(session_id),
                task_queue=names.WORKFLOW_TASK_QUEUE,
                start_signal="heartbeat",
                search_attributes=names.search_attributes(
                    (names.SESSION_ID, session_id), (names.STATUS, "active"), (names.OWNER, names.owner_value(owner))
                ),
                static_summary=f"OpenAI-compatible endpoint session {session_id}",
            )
        except Exception as e:
            raise from_temporal(e, f"session {session_id}") from None
        self.beaten_at[session_id] = time.monotonic()

    async def tokenizer(self, name: str, local_path: str) -> Any:
        """The base model's tokenizer (loaded once per process, offline: the model is on this machine)."""
        cached = self.tokenizers.get(name)
        if cached is not None:
            return cached
        async with self._tokenizer_lock:
            if name not in self.tokenizers:
                self.tokenizers[name] = await asyncio.to_thread(_load_tokenizer, local_path or name, name)
        return self.tokenizers[name]


def _load_tokenizer(path: str, name: str) -> Any:
    from transformers import (
        AutoTokenizer,  # heavy: imported on the first OpenAI call only
    )

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception:
        if path == name:
            raise
        return AutoTokenizer.from_pretrained(name)  # another host's path: the HF id in this host's cache


def _session_ended(e: BaseException) -> bool:
    cause = e.cause if isinstance(e, WorkflowUpdateFailedError) else e
    return isinstance(cause, ApplicationError) and cause.type == "SessionEnded"
