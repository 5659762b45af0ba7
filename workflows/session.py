"""SessionWorkflow: one per SDK session, id `session/<session_id>` (docs/architecture.md §The workflows).

Heartbeats arrive as signals. When none arrives within the timeout, or the SDK finishes the session, it closes its
training runs (which frees their adapter slots), drops its ephemeral sampler snapshots, records why, and ends.
It is also the registry of the session's sampling sessions (`<session_id>:sample:<n>`).
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.error_types import ErrorType
from tinkerflow.workflows.protocol.messages import (
    DropSnapshots,
    SamplerInfo,
    SamplerRequest,
    SessionStart,
    SessionState,
    WorkKind,
    WorkResult,
)
from tinkerflow.workflows.requester import CoordinatorCalls

CONTINUE_AS_NEW_EVENTS = 4_000
RESOLVE_TIMEOUT = timedelta(seconds=30)


@workflow.defn(name="Session")
class SessionWorkflow:
    @workflow.init
    def __init__(self, start: SessionStart, carried: SessionState | None = None) -> None:
        self.s = carried or SessionState(
            session_id=start.session_id,
            owner=start.owner,
            user_metadata=dict(start.user_metadata),
            display_name=start.display_name,
        )
        self._beat = False
        self._finish: str = ""
        self._calls = CoordinatorCalls()

    @workflow.run
    async def run(self, start: SessionStart, carried: SessionState | None = None) -> SessionState:
        timeout = timedelta(seconds=start.heartbeat_timeout_s)
        self._publish()
        while True:
            try:
                await workflow.wait_condition(lambda: self._beat or bool(self._finish), timeout=timeout)
            except TimeoutError:
                self.s.status, self.s.reason = "timed_out", f"no heartbeat for {start.heartbeat_timeout_s:g}s"
                break
            if self._finish:
                self.s.status, self.s.reason = "finished", self._finish
                break
            self._beat = False
            info = workflow.info()
            if info.is_continue_as_new_suggested() or info.get_current_history_length() > CONTINUE_AS_NEW_EVENTS:
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(args=[start, self.s])
        await self._clean_up()
        self._publish()
        return self.s

    async def _clean_up(self) -> None:
        workflow.logger.info("session %s ends: %s", self.s.session_id, self.s.reason)
        for model_id in self.s.training_run_ids:
            try:
                await workflow.get_external_workflow_handle(names.run_workflow_id(model_id)).signal(
                    "close", f"session {self.s.status}: {self.s.reason}"
                )
            except Exception as e:  # the run may already be closed
                workflow.logger.info("run %s not signalled: %s", model_id, e)
        prefix = f"{self.s.session_id}:sample:"
        coordinators = {(i.base_model, i.pool) for i in self.s.samplers.values() if i.snapshot.startswith(prefix)}
        for base_model, pool in sorted(coordinators):
            await self._calls.call(
                names.coordinator_workflow_id(base_model, pool),
                WorkKind.DROP_SNAPSHOTS,
                session_id=self.s.session_id,
                drop=DropSnapshots(prefix=prefix),
                wait=False,
            )

    # --- messages ------------------------------------------------------------------------------------------------

    @workflow.signal
    def heartbeat(self) -> None:
        self._beat = True
        self.s.heartbeats += 1

    @workflow.signal
    def finish(self, reason: str) -> None:
        self._finish = reason or "finished"

    @workflow.signal
    def set_project(self, project_id: str) -> None:
        self.s.project_id = project_id

    @workflow.signal
    def run_started(self, model_id: str) -> None:
        if model_id not in self.s.training_run_ids:
            self.s.training_run_ids.append(model_id)
            self._publish()

    @workflow.signal
    def sampler_created(self, info: SamplerInfo) -> None:
        self.s.samplers[info.sampler_id] = info
        self._publish()

    @workflow.signal
    def deliver(self, result: WorkResult) -> None:
        self._calls.on_deliver(result)

    @workflow.update
    def register_sampler(self, req: SamplerRequest) -> SamplerInfo:
        sampler_id = names.sampler_id_for(self.s.session_id, req.seq)
        if sampler_id not in self.s.samplers:
            self.s.samplers[sampler_id] = SamplerInfo(
                sampler_id=sampler_id,
                base_model=req.base_model,
                model_path=req.model_path,
                snapshot=req.model_path,
                pool=req.pool,
                owner=self.s.owner,
            )
            self._publish()
        return self.s.samplers[sampler_id]

    @register_sampler.validator
    def _validate_register(self, req: SamplerRequest) -> None:
        if self.s.status != "active" or self._finish:
            raise ApplicationError(f"session {self.s.session_id} is {self.s.status}", type=ErrorType.SESSION_ENDED)

    @workflow.update
    async def resolve_sampler(self, sampler_id: str) -> SamplerInfo:
        # An ephemeral sampler is announced by its training run a moment before the SDK may use it; wait briefly.
        try:
            await workflow.wait_condition(lambda: sampler_id in self.s.samplers, timeout=RESOLVE_TIMEOUT)
        except TimeoutError:
            # An ApplicationError fails this update; any other exception would fail the workflow task and wedge
            # the whole session (heartbeats, finish, clean-up) until a code change.
            raise ApplicationError(
                f"unknown sampling session {sampler_id}", type=ErrorType.UNKNOWN_SAMPLER, non_retryable=True
            ) from None
        return self.s.samplers[sampler_id]

    @workflow.update
    def join_sampler(self, sampler_id: str) -> int:
        """A new client of one of this session's samplers (an unpickled SamplingClient): its number, unique among the
        sampler's clients (the original is 0), so clones never reuse each other's request seq_ids."""
        count = self.s.sampler_clients.get(sampler_id, 0) + 1
        self.s.sampler_clients[sampler_id] = count
        return count

    @join_sampler.validator
    def _validate_join(self, sampler_id: str) -> None:
        if sampler_id not in self.s.samplers:
            raise ApplicationError(f"unknown sampling session {sampler_id}", type=ErrorType.UNKNOWN_SAMPLER)

    @workflow.query
    def describe(self) -> SessionState:
        return self.s

    def _publish(self) -> None:
        workflow.set_current_details(
            f"{self.s.status} · {len(self.s.training_run_ids)} training run(s) · {len(self.s.samplers)} sampler(s)"
            + (f" · {self.s.reason}" if self.s.reason else "")
        )
        # temporalio types the legacy untyped form of this argument as partially unknown.
        workflow.upsert_search_attributes([names.STATUS.value_set(self.s.status)])  # pyright: ignore[reportUnknownMemberType]
