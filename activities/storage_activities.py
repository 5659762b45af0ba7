"""Activities the workflow worker hosts: storage housekeeping that needs I/O but no accelerator."""

from __future__ import annotations

import logging

from temporalio import activity

from tinkerflow.common.checkpoints import AUTO_SEGMENT, CheckpointStore, TinkerPath
from tinkerflow.common.store import ClaimCheckStore

log = logging.getLogger(__name__)
# Everything the store holds per request, swept on one retention: bodies and results, the futures records asample
# writes for retrieve_futures (api/session_futures.py), cancel_future's markers, and the stability records of calls
# that set record_stability_info (common/stability_records.py), and the copies of ephemeral sampler snapshots'
# weights (activities/sampler_weights.py).
CLAIM_CHECK_KINDS = ("requests", "results", "futures", "cancelled", "stability", "sampler-weights", "audit")


class StorageActivities:
    def __init__(self, checkpoints: CheckpointStore, store: ClaimCheckStore | None = None, retention_s: float = 0):
        self.checkpoints = checkpoints
        self.store = store
        self.retention_s = retention_s

    @activity.defn(name="delete_internal_checkpoint")
    def delete_internal_checkpoint(self, tinker_path: str) -> bool:
        """A closed run's automatic snapshot (never a user's checkpoint: those are deleted through the API)."""
        p = TinkerPath.parse(tinker_path)
        if p.segment != AUTO_SEGMENT:
            raise ValueError(f"{tinker_path} is not an automatic snapshot")
        return self.checkpoints.delete(p)

    @activity.defn(name="sweep_claim_checks")
    def sweep_claim_checks(self) -> dict[str, int]:
        """Collect claim-check objects older than this worker's --store-retention-s (0: keep everything)."""
        if self.store is None or self.retention_s <= 0:
            return {"objects": 0, "bytes": 0}
        objects = freed = 0
        for kind in CLAIM_CHECK_KINDS:
            n, b = self.store.sweep(kind, self.retention_s)
            objects, freed = objects + n, freed + b
        if objects:
            log.info(
                "claim-check store: collected %d objects (%d bytes) older than %gs", objects, freed, self.retention_s
            )
        return {"objects": objects, "bytes": freed}

    @activity.defn(name="delete_expired_checkpoint")
    def delete_expired_checkpoint(self, tinker_path: str, expires_at: str) -> bool:
        """Delete the checkpoint if it still carries this expiry; a TTL moved or a name re-saved keeps it."""
        p = TinkerPath.parse(tinker_path)
        m = self.checkpoints.manifest(p, include_expired=True)
        if m is None or m.expires_at != expires_at:
            log.info(
                "not deleting %s: it is gone or its expiry changed (%s)",
                tinker_path,
                m.expires_at if m else "no manifest",
            )
            return False
        self.checkpoints.delete(p)
        log.info("deleted expired checkpoint %s (expired at %s)", tinker_path, expires_at)
        return True
