"""The audit log: who changed a checkpoint, a session or a run, with key id, time and object.

Kept in the claim-check store beside the bodies and results (kind `audit`), one small JSON object per event under
`audit/<YYYY-MM-DD>/`, so it lives on the same disk or bucket, is written without a read-modify-write (API replicas
never race on one file) and is collected by the StoreJanitor after `--store-retention-s`, like the rest of the store.

Recorded here: what a key does by a route the API answers at once (a checkpoint deleted, published, unpublished or
given a TTL; a session created or finished; a run created). Facts whose time only a workflow knows (a checkpoint's
commit, a session's timeout, a run's end) are read from where they already live durably, the checkpoint manifests
and Temporal's visibility, when the log is asked for (platform/api/usage_data.py), so they are never written twice.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime
from typing import Any

from tinkerflow.common.store import ClaimCheckStore

log = logging.getLogger(__name__)
KIND = "audit"


@dataclass(frozen=True)
class AuditEvent:
    """One entry: `event` is `<resource>_<action>` as the SDK's AuditLogEntry names them (`checkpoint_deleted`)."""

    time: datetime
    event: str
    key_id: str  # the caller's owner id (a keyed hash of its API key; "open" when the API takes any key)
    object: str  # a tinker:// path, a session id or a model id
    details: dict[str, Any] = field(default_factory=dict[str, Any])

    @property
    def resource(self) -> str:
        return self.event.split("_", 1)[0]

    def entry(self) -> dict[str, Any]:
        """The SDK's AuditLogEntry as JSON."""
        details = {"key_id": self.key_id, "object": self.object, **self.details}
        out: dict[str, Any] = {"timestamp": self.time.isoformat(), "event": self.event, "event_details": details}
        if self.resource == "checkpoint":
            out["tinker_path"] = self.object
            out["model_id"] = self.object.removeprefix("tinker://").split("/", 1)[0]
        return out

    def to_json(self) -> bytes:
        return json.dumps({**asdict(self), "time": self.time.isoformat()}, sort_keys=True).encode()

    @staticmethod
    def from_json(data: bytes) -> AuditEvent:
        raw = json.loads(data)
        return AuditEvent(
            time=datetime.fromisoformat(raw["time"]),
            event=str(raw["event"]),
            key_id=str(raw["key_id"]),
            object=str(raw["object"]),
            details=dict(raw.get("details") or {}),
        )


class AuditLog:
    """Blocking calls (fsspec): async callers wrap them in `asyncio.to_thread`."""

    def __init__(self, store: ClaimCheckStore):
        self.store = store

    def record(self, event: str, key_id: str, obj: str, **details: Any) -> AuditEvent:
        entry = AuditEvent(datetime.now(UTC), event, key_id or "open", obj, details)
        name = f"{entry.time.date().isoformat()}/{entry.time.strftime('%H%M%S.%f')}-{uuid.uuid4().hex[:8]}.json"
        try:
            self.store.fs.makedirs(f"{self.store.root}/{KIND}/{entry.time.date().isoformat()}", exist_ok=True)
            self.store.put_named(KIND, name, entry.to_json())
        except Exception:  # the change itself is done; a log write that fails must say so, not undo or hide it
            log.exception("audit: could not record %s of %s by %s", event, obj, entry.key_id)
        return entry

    def day(self, day: date) -> list[AuditEvent]:
        fs, folder = self.store.fs, f"{self.store.root}/{KIND}/{day.isoformat()}"
        try:
            paths = sorted(fs.glob(f"{folder}/*.json"))
        except FileNotFoundError:
            return []
        out: list[AuditEvent] = []
        for path in paths:
            try:
                with fs.open(path, "rb") as f:
                    out.append(AuditEvent.from_json(f.read()))
            except (FileNotFoundError, ValueError, KeyError) as e:  # collected meanwhile, or not ours
                log.debug("audit: skipping %s: %s", path, e)
        return out
