"""What a training run does with checkpoints: save_state, PEFT exports, sampler weights, loads and their TTL timers.

A part of `TrainingRunWorkflow` (training_run.py), kept apart because it is the run's storage side: every method
here asks the Coordinator for a JAX-worker write or load and records the outcome in the run's state. The class is a
mixin with no state of its own; the workflow supplies `s`, `_calls` and `_coordinator`.
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.workflow import ParentClosePolicy

from tinkerflow.workflows.checkpoint_expiry import CheckpointExpiry, ExpiryStart
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import (
    LoadCheckpoint,
    LoggedOp,
    LoraSpec,
    Outcome,
    RunState,
    SamplerInfo,
    SaveCheckpoint,
    SaveRequest,
    WorkKind,
)
from tinkerflow.workflows.protocol.usage import OpUsage, add_to, hour_of
from tinkerflow.workflows.requester import CoordinatorCalls

# kind="inflight" saves take the run's one inflight key instead of a snapshot per sampler.
PATCH_INFLIGHT = "sampling-inflight-v1"


class RunCheckpoints:
    s: RunState
    _calls: CoordinatorCalls
    _coordinator: str

    async def _save(self, save: SaveRequest, segment: str, kind: str) -> Outcome:
        """save_state (orbax training state) or save_weights_external (PEFT files), written by the JAX worker."""
        path = f"tinker://{self.s.start.model_id}/{segment}/{save.path}"
        outcome = await self._write_checkpoint(path, save)
        if not outcome.ok:
            return outcome
        if segment == "weights":
            self.s.last_checkpoint = path
        result: dict[str, Any] = {"path": path, "type": kind}
        if segment == "external_weights":
            result["size_bytes"] = int((outcome.json or {}).get("size_bytes", 0))
        return Outcome(json=result)

    async def _write_checkpoint(self, path: str, save: SaveRequest) -> Outcome:
        start = self.s.start
        ttl = save.ttl_seconds
        expires_at = rfc3339(workflow.now() + timedelta(seconds=int(ttl))) if ttl else None
        manifest = {
            "tinker_path": path,
            "owner": start.owner,
            "base_model": start.base_model,
            "lora": asdict(self.s.lora_spec),
            "step": self.s.step,
            "expires_at": expires_at,
            "user_metadata": dict(save.user_metadata),
        }
        # Only saves that name age recipients carry them (the API refused such saves before this change).
        recipients = (
            list(save.age_recipients)
            if save.age_recipients and workflow.patched("age-encrypted-external-weights")
            else []
        )
        outcome = await self._calls.call(
            self._coordinator,
            WorkKind.SAVE_CHECKPOINT,
            model_id=start.model_id,
            save=SaveCheckpoint(path=path, manifest=manifest, overwrite=save.overwrite, age_recipients=recipients),
        )
        if outcome.ok and "/auto_weights/" not in path:  # automatic snapshots are the service's, not the user's
            self._meter(outcome.usage)
            await self._schedule_expiry(path, expires_at)
        return outcome

    def _meter(self, usage: OpUsage | None) -> None:
        """Record an accepted op's usage in the run's hourly ledger: state only (no command), carried across
        continue-as-new, read by the API through the `usage` query."""
        add_to(self.s.usage, hour_of(workflow.now()), usage)

    async def _schedule_expiry(self, path: str, expires_at: str | None) -> None:
        """A durable timer per checkpoint with a TTL; a re-save of the name moves or clears an existing one."""
        wf_id = names.checkpoint_expiry_workflow_id(path)
        if expires_at is not None:
            try:
                await workflow.start_child_workflow(
                    CheckpointExpiry.run,
                    ExpiryStart(path, expires_at, self.s.start.base_model, self.s.start.pool),
                    id=wf_id,
                    parent_close_policy=ParentClosePolicy.ABANDON,
                    static_summary=f"expires {path} at {expires_at}",
                )
                return
            except WorkflowAlreadyStartedError:
                pass
        try:
            await workflow.get_external_workflow_handle(wf_id).signal(CheckpointExpiry.set_expiry, expires_at)
        except Exception:  # no expiry workflow for this name: nothing to move
            pass

    async def _load(self, path: str, optimizer: bool) -> Outcome:
        """Load a checkpoint into this run's slot; its LoRA config becomes the run's (docs/wire-contract.md §Training
        routes)."""
        load = LoadCheckpoint(path=path, optimizer=optimizer)
        outcome = await self._calls.call(
            self._coordinator, WorkKind.LOAD_CHECKPOINT, model_id=self.s.start.model_id, load=load
        )
        if outcome.ok:
            info = outcome.json or {}
            self.s.lora = LoraSpec(**info["lora"]) if info.get("lora") else self.s.lora
            if optimizer:
                self.s.step = int(info.get("step", self.s.step))
            self.s.loaded_from = path
            # The loaded checkpoint is the new base to restore from; what came before no longer matters.
            self.s.auto_snapshot = ""
            self.s.since_snapshot = []
            self._log(LoggedOp(WorkKind.LOAD_CHECKPOINT, load=load))
        return outcome

    def _log(self, entry: LoggedOp) -> None:
        """Remember a state-changing op since the last automatic snapshot (refs and params: history stays small)."""
        if self.s.start.snapshot_every:
            self.s.since_snapshot.append(entry)

    async def _save_for_sampler(self, save: SaveRequest) -> Outcome:
        start = self.s.start
        name = save.path
        if name:
            key = f"tinker://{start.model_id}/sampler_weights/{name}"
            sampler_id = ""
        else:
            seq = save.sampling_session_seq_id
            if seq is None:
                return Outcome.failed("save_weights_for_sampler needs a path or a sampling_session_seq_id")
            sampler_id = names.sampler_id_for(start.session_id, int(seq))
            key = sampler_id
            # Inflight: every inflight sampler of this run reads one key, which each inflight save re-takes, so old
            # and new inflight clients sample the newest weights; each save is still its own sampling session (a fresh
            # prefix-cache namespace).
            if save.inflight and workflow.patched(PATCH_INFLIGHT):
                key = names.inflight_key(start.model_id)
        if not sampler_id:
            # Named weights persist as PEFT files (any later sampler, session or worker can load them) ...
            outcome = await self._write_checkpoint(key, save)
            if not outcome.ok:
                return outcome
            self.s.last_sampler_checkpoint = key
        # ... and stay loaded as an immutable in-memory snapshot for the samplers that follow right away.
        outcome = await self._calls.call(self._coordinator, WorkKind.SNAPSHOT, model_id=start.model_id, snapshot=key)
        if not outcome.ok:
            return outcome
        self.s.sampler_count += 1
        if sampler_id:
            info = SamplerInfo(
                sampler_id=sampler_id,
                base_model=start.base_model,
                snapshot=key,
                source_model_id=start.model_id,
                pool=start.pool,
                owner=start.owner,
            )
            await self._tell_session("sampler_created", info)
            return Outcome(json={"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})
        return Outcome(json={"path": key, "type": "save_weights_for_sampler"})

    async def _tell_session(self, signal: str, arg: object) -> None:
        try:
            handle = workflow.get_external_workflow_handle(names.session_workflow_id(self.s.start.session_id))
            await handle.signal(signal, arg)
        except Exception as e:
            workflow.logger.warning("could not signal session %s: %s", self.s.start.session_id, e)


def rfc3339(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")
