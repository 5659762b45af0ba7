"""TrainingRunWorkflow: one per LoRA training client, id `training-run/<model_id>` (docs/architecture.md §The
workflows).

Every SDK op arrives as an Update carrying its `seq_id`. The SDK sends chunks concurrently (first chunk last), so
handlers wait their turn and run strictly in `seq_id` order. A retried request (same seq_id, same body) resolves to
the first answer: Temporal dedupes the update id within a run, and `answered` carries recent answers across
continue-as-new. A reused seq_id with a different body is rejected by the validator (the API answers 409).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.error_types import ErrorType
from tinkerflow.workflows.protocol.messages import (
    Answered,
    LoggedOp,
    OpKind,
    Outcome,
    RunStart,
    RunState,
    SaveRequest,
    TrainingOp,
    WorkKind,
    WorkResult,
)
from tinkerflow.workflows.protocol.usage import OpUsage
from tinkerflow.workflows.requester import CoordinatorCalls
from tinkerflow.workflows.run_checkpoints import rfc3339
from tinkerflow.workflows.run_recovery import RunRecovery

ANSWERED_KEPT = 128
RECOVERABLE_KINDS = {
    OpKind.FORWARD_BACKWARD,
    OpKind.OPTIM_STEP,
    OpKind.SAVE_WEIGHTS,
    OpKind.SAVE_WEIGHTS_EXTERNAL,
    OpKind.SAVE_WEIGHTS_FOR_SAMPLER,
    OpKind.LOAD_WEIGHTS,
}
STEP_ATTRIBUTE_EVERY = 10
# How many times one op restores its adapter when the worker keeps dying under it, before it fails (category server).
RECOVERY_ATTEMPTS = 3
PATCH_RECOVER_AGAIN = "run-recover-again-after-worker-lost"
# How far ahead of the run's next seq_id an op may be. The SDK numbers every op of a TrainingClient from one counter
# and sends its chunks concurrently, so a real client is a few dozen ahead at most; an op far beyond would wait for
# its gap forever. It is refused at submit (HTTP 400): the run's next seq_id is unchanged, so nothing else waits.
SEQ_WINDOW = 10_000
CONTINUE_AS_NEW_EVENTS = 6_000
RUN_METRICS_PATCH = "run-metrics-tags"


@workflow.defn(name="TrainingRun")
class TrainingRunWorkflow(RunRecovery):
    @workflow.init
    def __init__(self, start: RunStart, carried: RunState | None = None) -> None:
        self.s = carried or RunState(start=start)
        self._calls = CoordinatorCalls()
        self._closing = ""
        self._running_seq: int | None = None
        self._in_flight: dict[int, str] = {}  # seq_id -> body hash of ops accepted but not yet answered
        self._published: tuple[str, int] | None = None
        self._coordinator = names.coordinator_workflow_id(start.base_model, start.pool)

    @workflow.run
    async def run(self, start: RunStart, carried: RunState | None = None) -> RunState:
        if carried is None:
            await self._tell_session("run_started", start.model_id)
        while True:
            await workflow.wait_condition(lambda: bool(self._closing) or self._should_continue_as_new())
            await workflow.wait_condition(lambda: workflow.all_handlers_finished() and self._running_seq is None)
            if self._closing:
                break
            workflow.continue_as_new(args=[start, self.s])
        if self.s.status == "ready":
            await self._calls.call(self._coordinator, WorkKind.FREE_ADAPTER, model_id=start.model_id)
        if self.s.auto_snapshot:  # only recovery needed it; the user's own checkpoints stay
            try:
                await workflow.execute_activity(
                    "delete_internal_checkpoint",
                    self.s.auto_snapshot,  # on this workflow's own task queue
                    schedule_to_close_timeout=timedelta(minutes=10),
                    summary="delete the automatic snapshot",
                )
            except Exception as e:
                workflow.logger.warning("automatic snapshot %s not deleted: %s", self.s.auto_snapshot, e)
        self.s.status = "closed"
        self.s.error = self._closing
        self._publish()
        return self.s

    def _should_continue_as_new(self) -> bool:
        info = workflow.info()
        return info.is_continue_as_new_suggested() or info.get_current_history_length() > CONTINUE_AS_NEW_EVENTS

    # --- messages ------------------------------------------------------------------------------------------------

    @workflow.update
    async def create(self) -> Outcome:
        """The create_model future: place an adapter for this run on a worker."""
        if self.s.status == "starting":
            if self.s.lora_spec.seed is None:
                # Drawn here (deterministically, into history) so a recovery can re-create the very same init.
                self.s.lora = replace(self.s.lora_spec, seed=workflow.random().randint(0, 2**31 - 1))
            outcome = await self._create_adapter()
            if outcome.ok and self.s.start.load_path:
                outcome = await self._load(self.s.start.load_path, self.s.start.load_optimizer)
                if not outcome.ok:  # the slot was placed; give it back
                    await self._calls.call(self._coordinator, WorkKind.FREE_ADAPTER, model_id=self.s.start.model_id)
            if outcome.ok:
                self.s.status = "ready"
            else:
                self.s.status, self.s.error = "failed", outcome.error
                self._closing = outcome.error
                self._publish()
                return outcome
            self._publish()
        if self.s.status != "ready":
            return Outcome.failed(f"training run {self.s.start.model_id} is {self.s.status}: {self.s.error}")
        if self.s.start.load_path:
            return Outcome(
                json={"model_id": self.s.start.model_id, "path": self.s.start.load_path, "type": "load_weights"}
            )
        return Outcome(json={"model_id": self.s.start.model_id, "type": "create_model"})

    @workflow.update
    async def op(self, op: TrainingOp) -> Outcome:
        if str(op.seq_id) in self.s.answered:
            return self.s.answered[str(op.seq_id)].outcome
        # Two updates validated in one activation both pass the validator before either handler runs: the second
        # one with a different body is caught here.
        if self._in_flight.get(op.seq_id, op.body_hash) != op.body_hash:
            raise ApplicationError(
                f"seq_id {op.seq_id} was already used for a different request on {self.s.start.model_id}",
                type=ErrorType.SEQ_CONFLICT,
            )
        self._in_flight[op.seq_id] = op.body_hash
        try:
            await workflow.wait_condition(
                lambda: bool(self._closing) or (self.s.next_seq == op.seq_id and self._running_seq is None)
            )
            if not (self.s.next_seq == op.seq_id and self._running_seq is None):  # closed while waiting its turn
                return Outcome.failed(
                    f"training run {self.s.start.model_id} closed before seq_id {op.seq_id} ran: {self._closing}"
                )
            self._running_seq = op.seq_id
            self.s.last_request_time = rfc3339(workflow.now())
            try:
                outcome = await self._execute(op)
            finally:
                self._running_seq = None
        finally:
            self._in_flight.pop(op.seq_id, None)
        self.s.answered[str(op.seq_id)] = Answered(op.body_hash, outcome)
        for old in sorted(self.s.answered, key=int)[:-ANSWERED_KEPT]:
            del self.s.answered[old]
        self.s.next_seq = op.seq_id + 1
        self._publish()
        return outcome

    @op.validator
    def _validate_op(self, op: TrainingOp) -> None:
        # Rejections here never enter history; the API turns them into HTTP errors (409 for a reused seq_id).
        model_id = self.s.start.model_id
        if op.owner != self.s.start.owner:
            # Same answer as for a run that does not exist: another tenant learns nothing about it.
            raise ApplicationError(f"training run {model_id} does not exist", type=ErrorType.NOT_OWNER)
        if self._closing:
            raise ApplicationError(f"training run {model_id} is closed: {self._closing}", type=ErrorType.RUN_CLOSED)
        first = self.s.answered.get(str(op.seq_id))
        in_flight = self._in_flight.get(op.seq_id)
        if in_flight is not None and in_flight != op.body_hash:
            raise ApplicationError(
                f"seq_id {op.seq_id} is in flight with a different request on {model_id}", type=ErrorType.SEQ_CONFLICT
            )
        if first is not None and first.body_hash != op.body_hash:
            raise ApplicationError(
                f"seq_id {op.seq_id} was already used for a different request on {model_id}",
                type=ErrorType.SEQ_CONFLICT,
            )
        if op.seq_id > self.s.next_seq + SEQ_WINDOW:
            # A validator change needs no workflow.patched: rejected updates never enter history.
            raise ApplicationError(
                f"seq_id {op.seq_id} on {model_id} is more than {SEQ_WINDOW:,} ahead of the run's next "
                f"({self.s.next_seq}); it would wait for the gap forever",
                type=ErrorType.SEQ_TOO_FAR,
            )
        if first is None and op.seq_id < self.s.next_seq:
            raise ApplicationError(
                f"seq_id {op.seq_id} on {model_id} is older than the answers this run keeps "
                f"(next is {self.s.next_seq})",
                type=ErrorType.SEQ_CONFLICT,
            )

    @workflow.signal
    def deliver(self, result: WorkResult) -> None:
        self._calls.on_deliver(result)

    @workflow.signal
    def close(self, reason: str) -> None:
        self._closing = reason or "closed"

    @workflow.query
    def describe(self) -> RunState:
        return self.s

    @workflow.query
    def usage(self) -> dict[str, OpUsage]:
        """The run's metered usage by UTC hour (workflows/protocol/usage.py); the billing routes read it."""
        return self.s.usage

    # --- ops -----------------------------------------------------------------------------------------------------

    async def _execute(self, op: TrainingOp) -> Outcome:
        if self.s.status != "ready":
            return Outcome.failed(f"training run {self.s.start.model_id} is {self.s.status}: {self.s.error}")
        outcome = await self._execute_once(op)
        if not (outcome.worker_lost and op.kind in RECOVERABLE_KINDS):
            return outcome
        attempt = 0
        while True:
            attempt += 1
            restored = await self._recover(outcome.error)
            if restored.ok:
                outcome = await self._execute_once(op)
                if not outcome.worker_lost:
                    return outcome
                answer = outcome
            else:
                answer = Outcome.failed(f"{outcome.error}; restoring the adapter failed: {restored.error}", "server")
                if not restored.worker_lost:
                    return answer
            # The worker died again, during the restore or the op: a multi-host group re-forms in steps (Ray restarts
            # one actor, then its peers are restarted), so a restore can land on a group that is about to go. Restore
            # again on whatever is live now. Histories recorded before this loop answered here; the patch keeps them.
            if attempt >= RECOVERY_ATTEMPTS or not workflow.patched(PATCH_RECOVER_AGAIN):
                return answer

    async def _execute_once(self, op: TrainingOp) -> Outcome:
        model_id = self.s.start.model_id
        # Tag the engine item with the op's seq_id and the run's step: the JAX worker records the op's metric point.
        # Patched: the items this workflow signals change.
        seq_id, step = (op.seq_id, self.s.step) if workflow.patched(RUN_METRICS_PATCH) else (None, 0)
        if op.kind is OpKind.FORWARD_BACKWARD:
            outcome = await self._calls.call(
                self._coordinator,
                WorkKind.FORWARD_BACKWARD,
                model_id=model_id,
                payload=op.payload,
                seq_id=seq_id,
                step=step,
            )
            if outcome.ok:
                self._log(LoggedOp(WorkKind.FORWARD_BACKWARD, payload=op.payload))
                self._meter(outcome.usage)  # before the answer is slimmed below: the SDK never sees usage
            if outcome.ok and outcome.json:
                self.s.fwdbwd_count += 1
                self.s.tokens_seen += int(outcome.json.get("tokens", 0))
                self.s.last_loss = outcome.json.get("loss")
                # The proto result is what the SDK reads; the JSON summary was only for this run's state.
                outcome = Outcome(blob=outcome.blob)
            return outcome
        if op.kind is OpKind.OPTIM_STEP:
            outcome = await self._calls.call(
                self._coordinator, WorkKind.OPTIM_STEP, model_id=model_id, adam=op.adam, seq_id=seq_id, step=step
            )
            if outcome.ok:
                self.s.step += 1
                self._log(LoggedOp(WorkKind.OPTIM_STEP, adam=op.adam))
                every = self.s.start.snapshot_every
                if every and self.s.step % every == 0:
                    await self._auto_snapshot()
            return outcome
        save = op.save or SaveRequest()
        if op.kind is OpKind.SAVE_WEIGHTS_FOR_SAMPLER:
            return await self._save_for_sampler(save)
        if op.kind in (OpKind.SAVE_WEIGHTS, OpKind.SAVE_WEIGHTS_EXTERNAL) and not save.path:
            return Outcome.failed(f"{op.kind} needs a checkpoint name")
        if op.kind is OpKind.SAVE_WEIGHTS:
            return await self._save(save, "weights", "save_weights")
        if op.kind is OpKind.SAVE_WEIGHTS_EXTERNAL:
            return await self._save(save, "external_weights", "save_weights_external")
        if op.kind is OpKind.LOAD_WEIGHTS and op.load is not None and op.load.path:
            outcome = await self._load(op.load.path, op.load.optimizer)
            return (
                Outcome(json={"model_id": model_id, "path": op.load.path, "type": "load_weights"})
                if outcome.ok
                else outcome
            )
        if op.kind is OpKind.REJECT:
            return Outcome.failed(op.error or "rejected")
        return Outcome.failed(f"unsupported training op {op.kind!r}")

    # --- visibility ----------------------------------------------------------------------------------------------

    def _publish(self) -> None:
        s = self.s
        loss = f" · last loss {s.last_loss:.4g}" if s.last_loss is not None else ""
        workflow.set_current_details(
            f"{s.status} · step {s.step} · {s.fwdbwd_count} fwd/bwd · {s.tokens_seen:,} tokens{loss}"
        )
        # An upsert is a history event plus a visibility write on every op; keep search attributes coarse (status on
        # change, step every STEP_ATTRIBUTE_EVERY steps) and the exact step in the details line and the query.
        step_mark = s.step - s.step % STEP_ATTRIBUTE_EVERY
        if (s.status, step_mark) != self._published:
            self._published = (s.status, step_mark)
            # The ignore below: temporalio annotates the parameter with a bare generic
            # (Sequence[SearchAttributeUpdate]).
            workflow.upsert_search_attributes([names.STEP.value_set(step_mark), names.STATUS.value_set(s.status)])  # pyright: ignore[reportUnknownMemberType]
