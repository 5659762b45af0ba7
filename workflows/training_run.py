"""TrainingRunWorkflow: one per LoRA training client, id `training-run/<model_id>` (DESIGN §2).

Every SDK op arrives as an Update carrying its `seq_id`. The SDK sends chunks concurrently (first chunk last), so
handlers wait their turn and run strictly in `seq_id` order. A retried request (same seq_id, same body) resolves to
the first answer: Temporal dedupes the update id within a run, and `answered` carries recent answers across
continue-as-new. A reused seq_id with a different body is rejected by the validator (the API answers 409).
"""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ApplicationError

from tinkerflow.workflows import names
from tinkerflow.workflows.messages import Answered, Outcome, RunStart, RunState, SamplerInfo, TrainingOp, WorkResult
from tinkerflow.workflows.requester import CoordinatorCalls

ANSWERED_KEPT = 128
STEP_ATTRIBUTE_EVERY = 10
CONTINUE_AS_NEW_EVENTS = 6_000


@workflow.defn(name="TrainingRun")
class TrainingRunWorkflow:
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
            await self._calls.call(self._coordinator, "free_adapter", model_id=start.model_id)
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
            lora = self.s.start.lora
            outcome = await self._calls.call(
                self._coordinator, "create_adapter", model_id=self.s.start.model_id,
                session_id=self.s.start.session_id,
                params={"rank": lora.rank, "seed": lora.seed, "train_attn": lora.train_attn,
                        "train_mlp": lora.train_mlp, "train_unembed": lora.train_unembed},
            )
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
        return Outcome(json={"model_id": self.s.start.model_id, "type": "create_model"})

    @workflow.update
    async def op(self, op: TrainingOp) -> Outcome:
        if str(op.seq_id) in self.s.answered:
            return self.s.answered[str(op.seq_id)].outcome
        # Two updates validated in one activation both pass the validator before either handler runs: the second
        # one with a different body is caught here.
        if self._in_flight.get(op.seq_id, op.body_hash) != op.body_hash:
            raise ApplicationError(f"seq_id {op.seq_id} was already used for a different request on "
                                   f"{self.s.start.model_id}", type="SeqConflict")
        self._in_flight[op.seq_id] = op.body_hash
        try:
            await workflow.wait_condition(
                lambda: bool(self._closing) or (self.s.next_seq == op.seq_id and self._running_seq is None))
            if not (self.s.next_seq == op.seq_id and self._running_seq is None):  # closed while waiting its turn
                return Outcome.failed(f"training run {self.s.start.model_id} closed before seq_id {op.seq_id} "
                                      f"ran: {self._closing}")
            self._running_seq = op.seq_id
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
            raise ApplicationError(f"training run {model_id} does not exist", type="NotOwner")
        if self._closing:
            raise ApplicationError(f"training run {model_id} is closed: {self._closing}", type="RunClosed")
        first = self.s.answered.get(str(op.seq_id))
        in_flight = self._in_flight.get(op.seq_id)
        if in_flight is not None and in_flight != op.body_hash:
            raise ApplicationError(f"seq_id {op.seq_id} is in flight with a different request on {model_id}",
                                   type="SeqConflict")
        if first is not None and first.body_hash != op.body_hash:
            raise ApplicationError(f"seq_id {op.seq_id} was already used for a different request on {model_id}",
                                   type="SeqConflict")
        if first is None and op.seq_id < self.s.next_seq:
            raise ApplicationError(
                f"seq_id {op.seq_id} on {model_id} is older than the answers this run keeps (next is {self.s.next_seq})",
                type="SeqConflict")

    @workflow.signal
    def deliver(self, result: WorkResult) -> None:
        self._calls.on_deliver(result)

    @workflow.signal
    def close(self, reason: str) -> None:
        self._closing = reason or "closed"

    @workflow.query
    def describe(self) -> RunState:
        return self.s

    # --- ops -----------------------------------------------------------------------------------------------------

    async def _execute(self, op: TrainingOp) -> Outcome:
        if self.s.status != "ready":
            return Outcome.failed(f"training run {self.s.start.model_id} is {self.s.status}: {self.s.error}")
        model_id = self.s.start.model_id
        if op.kind == "forward_backward":
            outcome = await self._calls.call(self._coordinator, "forward_backward", model_id=model_id,
                                             payload=op.payload, params=op.params)
            if outcome.ok and outcome.json:
                self.s.fwdbwd_count += 1
                self.s.tokens_seen += int(outcome.json.get("tokens", 0))
                self.s.last_loss = outcome.json.get("loss")
                # The proto result is what the SDK reads; the JSON summary was only for this run's state.
                outcome = Outcome(blob=outcome.blob)
            return outcome
        if op.kind == "optim_step":
            outcome = await self._calls.call(self._coordinator, "optim_step", model_id=model_id, params=op.params)
            if outcome.ok:
                self.s.step += 1
            return outcome
        if op.kind == "save_weights_for_sampler":
            return await self._save_for_sampler(op)
        if op.kind == "reject":
            return Outcome.failed(str(op.params.get("error", "rejected")))
        return Outcome.failed(f"unsupported training op {op.kind!r}")

    async def _save_for_sampler(self, op: TrainingOp) -> Outcome:
        start = self.s.start
        name = op.params.get("path")
        if name:
            if "/" in name or not name.strip():
                return Outcome.failed(f"checkpoint name {name!r} must be non-empty and contain no '/'")
            key = f"tinker://{start.model_id}/sampler_weights/{name}"
            sampler_id = ""
        else:
            seq = op.params.get("sampling_session_seq_id")
            if seq is None:
                return Outcome.failed("save_weights_for_sampler needs a path or a sampling_session_seq_id")
            sampler_id = names.sampler_id_for(start.session_id, int(seq))
            key = sampler_id
        outcome = await self._calls.call(self._coordinator, "snapshot", model_id=start.model_id,
                                         params={"key": key})
        if not outcome.ok:
            return outcome
        self.s.sampler_count += 1
        if sampler_id:
            info = SamplerInfo(sampler_id=sampler_id, base_model=start.base_model, snapshot=key,
                               source_model_id=start.model_id, pool=start.pool, owner=start.owner)
            await self._tell_session("sampler_created", info)
            return Outcome(json={"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"})
        return Outcome(json={"path": key, "type": "save_weights_for_sampler"})

    # --- visibility ----------------------------------------------------------------------------------------------

    async def _tell_session(self, signal: str, arg) -> None:
        try:
            handle = workflow.get_external_workflow_handle(names.session_workflow_id(self.s.start.session_id))
            await handle.signal(signal, arg)
        except Exception as e:
            workflow.logger.warning("could not signal session %s: %s", self.s.start.session_id, e)

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
            workflow.upsert_search_attributes([names.STEP.value_set(step_mark), names.STATUS.value_set(s.status)])

