"""The mocked JAX worker of the workflow unit tests (wf_harness.py builds each test's world around it): `MockEngine`
stands in for the worker's `run_batch`, `jax_worker` serves it on a task queue of its own, and the helpers read the
flags and seq_ids `Tinker.fwd` puts in a forward_backward item's payload URI.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import Batch, BatchResult, BlobRef, Outcome, WorkItem, WorkResult

STEP_TIMEOUT = 20.0  # seconds any single wait in a test may take before it counts as a hang


def fwd_flags(item: WorkItem) -> set[str]:
    """The flags Tinker.fwd put in a forward_backward item's payload URI ("mem://request/<seq>/<tag>?hold&bad")."""
    if item.payload is None or not item.payload.uri.startswith("mem://request/"):
        return set()
    return {f for f in item.payload.uri.partition("?")[2].split("&") if f}


def fwd_seq(item: WorkItem) -> int:
    """The seq_id of the op a forward_backward item came from (Tinker.fwd's payload URI)."""
    assert item.payload is not None
    return int(item.payload.uri.split("/")[3])


def blob(uri: str) -> BlobRef:
    return BlobRef(uri=uri, size=3, sha256=hashlib.sha256(uri.encode()).hexdigest())


class MockEngine:
    """Stands in for the JAX worker's `run_batch`: records every Batch and answers every WorkItem.

    forward_backward items whose payload carries the flag "bad" (Tinker.fwd(..., bad=True)) get an error Outcome;
    batches holding an item flagged "hold" wait until `release` is set (a slow engine), so work queued meanwhile
    can be watched being batched; the first batch holding an op flagged "lost" fails as a restarted worker refuses
    its predecessor's batches, and so does every later batch placed for that incarnation. Like the JAX worker, it
    runs one batch at a time, each after the batch it names in `Batch.after` (pipelined dispatch): `batches` is the
    order they arrived in, `ran` the order they ran in.
    """

    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self.ran: list[Batch] = []
        self.release = asyncio.Event()
        self.changed = asyncio.Condition()
        self._running = False
        self.refused: set[str] = set()  # ops flagged "lost" whose batch was refused once
        self.dead: set[str] = set()  # incarnations whose batches are refused from then on

    def answer(self, item: WorkItem) -> Outcome:
        if "bad" in fwd_flags(item) or (item.payload is not None and item.payload.uri.startswith("bad:")):
            return Outcome.failed(f"mock engine refused {item.kind} {item.key}", "user")
        if item.kind == "create_adapter":
            return Outcome(json={"slot": item.slot, "model_id": item.model_id})
        if item.kind == "forward_backward":
            return Outcome(json={"loss": 1.0, "tokens": 3}, blob=blob(f"mem://fwd/{item.key}"))
        if item.kind == "optim_step":
            return Outcome(json={"metrics": {"slot": item.slot}})
        if item.kind == "sample":
            return Outcome(
                json={"sequences": [[1, 2, 3]], "key": item.key, "snapshot": item.snapshot or None},
                blob=blob(f"mem://sample/{item.key}"),
            )
        if item.kind == "snapshot":
            return Outcome(json={"key": item.snapshot})
        if item.kind == "save_checkpoint":
            assert item.save is not None
            return Outcome(json={"path": item.save.path, "size_bytes": 1234})
        if item.kind == "load_checkpoint":  # a checkpoint saved with rank 4, mlp untrained, after 3 steps
            assert item.load is not None
            lora = {"rank": 4, "seed": None, "train_attn": True, "train_mlp": False, "train_unembed": True}
            return Outcome(json={"lora": lora, "step": 3 if item.load.optimizer else 0, "path": item.load.path})
        return Outcome(json={})  # free_adapter, drop_snapshots

    async def run_batch(self, batch: Batch) -> BatchResult:
        async with self.changed:
            self.batches.append(batch)
            self.changed.notify_all()
            await self.changed.wait_for(lambda: not self._running and (not batch.after or self.has_run(batch.after)))
            self._running = True
        try:
            if any("hold" in fwd_flags(i) for i in batch.items):
                await self.release.wait()
            lost = {i.payload.uri for i in batch.items if "lost" in fwd_flags(i) and i.payload is not None}
            # What a restarted worker says of its predecessor's batches (once per op): every batch placed for that
            # incarnation, the one queued behind included, as the JAX worker's incarnation check refuses them.
            if lost - self.refused or (batch.incarnation and batch.incarnation in self.dead):
                self.refused |= lost
                self.dead.add(batch.incarnation)
                raise ApplicationError("placed on an earlier process", type="WorkerLost", non_retryable=True)
            return BatchResult(results=[WorkResult(key=i.key, outcome=self.answer(i)) for i in batch.items])
        finally:
            async with self.changed:
                self._running = False
                self.ran.append(batch)
                self.changed.notify_all()

    def has_run(self, batch_id: str) -> bool:
        return any(b.batch_id == batch_id for b in self.ran)

    # --- what the tests look at ---

    @property
    def items(self) -> list[WorkItem]:
        return [i for b in self.batches for i in b.items]

    def of_kind(self, kind: str) -> list[WorkItem]:
        return [i for i in self.items if i.kind == kind]

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = STEP_TIMEOUT) -> None:
        async def _wait() -> None:
            async with self.changed:
                await self.changed.wait_for(predicate)

        await asyncio.wait_for(_wait(), timeout)


@asynccontextmanager
async def jax_worker(client: Client, engine: MockEngine, queue: str, depth: int = 1) -> AsyncIterator[Worker]:
    """The mocked JAX worker on `queue`, holding up to `depth` batches at once (2: pipelined dispatch)."""

    @activity.defn(name="run_batch")
    async def run_batch(batch: Batch) -> BatchResult:
        return await engine.run_batch(batch)

    worker = Worker(client, task_queue=queue, activities=[run_batch], max_concurrent_activities=max(1, depth))
    async with worker:
        yield worker


def new_queue(pool: str = "default") -> str:
    return names.worker_task_queue("unused", pool, f"mock-{uuid.uuid4().hex[:8]}")
