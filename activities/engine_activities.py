"""The JAX worker's one activity, `run_batch`: execute a coordinator batch on the engine, in order.

Consecutive forward_backward items run as ONE engine call (one pass over many adapters' examples), consecutive
sample items as one decode batch. Inputs and results cross through the claim-check store; only refs come back.
A batch Temporal retries after a transient failure does not re-apply work this process already did: answers are
remembered by item key.

Each answer is also signalled straight to the workflow that asked (`deliver`), the moment its group is done:
that saves the requester a coordinator workflow task and a second signal hop (~15 ms per op on a small machine).
The coordinator still sees the whole batch result for its bookkeeping and delivers only what failed here.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import logging
import threading
import time
from collections import OrderedDict
from itertools import groupby
from typing import cast

from temporalio import activity
from temporalio.exceptions import ApplicationError

from tinkerflow.activities import checkpoint_io, wire
from tinkerflow.common import metrics
from tinkerflow.common.checkpoints import CheckpointError, CheckpointStore
from tinkerflow.common.storage_faults import storage_fault
from tinkerflow.common.store import ClaimCheckStore
from tinkerflow.workers.engine.types import AdamConfig, InputError, LoraConfig
from tinkerflow.workflows.messages import Batch, BatchResult, Outcome, WorkItem, WorkResult

log = logging.getLogger(__name__)
REMEMBERED_ANSWERS = 4096
GROUPED_KINDS = {"forward_backward", "sample"}
CHECKPOINT_KINDS = {"save_checkpoint", "load_checkpoint", "load_snapshot"}
# Heartbeats tell Temporal a long batch is alive; a 5 ms optimizer step needs none (each one is an RPC).
HEARTBEAT_EVERY_S = 5.0


@contextlib.contextmanager
def _heartbeats(every_s: float):
    """Heartbeat from a side thread while the engine works, so one long engine call still proves the worker alive.

    The thread runs in a copy of this activity's context, which is what `activity.heartbeat` looks up.
    """
    progress = ["starting"]
    done = threading.Event()
    context = contextvars.copy_context()

    def beat() -> None:
        while not done.wait(every_s):
            activity.heartbeat(progress[0])

    thread = threading.Thread(target=context.run, args=(beat,), daemon=True, name="heartbeat")
    thread.start()
    try:
        yield progress
    finally:
        done.set()
        thread.join()


def _observe(kind: str, n: int, outcomes: list[Outcome], seconds: float) -> None:
    metrics.ENGINE_OP_SECONDS.labels(kind).observe(seconds)
    metrics.BATCH_ITEMS.labels(kind).observe(n)
    tokens = sum(int((o.json or {}).get("tokens", 0)) for o in outcomes if o.ok)
    if tokens:
        metrics.ENGINE_TOKENS.labels(kind).inc(tokens)
        metrics.ENGINE_TOKENS_PER_S.labels(kind).set(tokens / max(seconds, 1e-9))
    if kind in ("create_adapter", "free_adapter"):
        metrics.ADAPTER_SLOTS_USED.inc(sum(1 for o in outcomes if o.ok) * (1 if kind == "create_adapter" else -1))


class EngineActivities:
    def __init__(self, engine, store: ClaimCheckStore, deliver=None, checkpoints: CheckpointStore | None = None,
                 incarnation: str = ""):
        self.engine = engine
        self.incarnation = incarnation
        self.store = store
        self.checkpoints = checkpoints
        # callable(requester workflow id, WorkResult) -> concurrent.futures.Future of the signal, or None
        self.deliver = deliver
        self._answers: OrderedDict[str, Outcome] = OrderedDict()
        self._snapshots: set[str] = set()
        self._delivered: set[str] = set()
        self._load_errors: dict[str, str] = {}  # saved weights a sample batch asked for that failed to load

    @activity.defn(name="run_batch")
    def run_batch(self, batch: Batch) -> BatchResult:
        if batch.incarnation and self.incarnation and batch.incarnation != self.incarnation:
            # A retry of a batch placed on this worker's previous process: the slots it names are not ours.
            raise ApplicationError(f"this batch was placed on an earlier process of this JAX worker "
                                   f"({batch.incarnation[:8]}, now {self.incarnation[:8]}), which died or restarted",
                                   type="WorkerLost", non_retryable=True)
        todo = [i for i in batch.items if i.key not in self._answers]
        sent: dict[str, concurrent.futures.Future] = {}
        with _heartbeats(HEARTBEAT_EVERY_S) as progress:
            self._run_items(todo, sent, progress)
        for key, future in sent.items():  # only a confirmed delivery lets the coordinator skip its own
            try:
                future.result(timeout=10)
                self._delivered.add(key)
            except Exception as e:
                log.info("early delivery of %s failed (%s); the coordinator will deliver it", key, e)
        return BatchResult(results=[
            WorkResult(key=i.key, outcome=self._answers[i.key], delivered=i.key in self._delivered)
            for i in batch.items])

    def _run_items(self, todo: list[WorkItem], sent: dict, progress: list[str]) -> None:
        for _, group in groupby(todo, key=lambda i: i.kind if i.kind in GROUPED_KINDS else i.key):
            group = list(group)
            progress[0] = f"{group[0].kind} ×{len(group)}"
            started = time.perf_counter()
            try:
                outcomes = self._run_group(group[0].kind, group)
            except Exception as e:  # an engine bug must not take the other requests of the batch with it
                fault = storage_fault(e)
                if fault:  # the storage, not the engine: say which store and why, not an internal path
                    which, url = (("checkpoint", self.checkpoints.url)
                                  if group[0].kind in CHECKPOINT_KINDS and self.checkpoints is not None
                                  else ("claim-check", self.store.url))
                    log.error("%s ×%d: the %s store %s refused: %s (%s)", group[0].kind, len(group), which, url,
                              fault, e)
                    message = (f"{group[0].kind} failed: the {which} store ({url}) refused it: {fault}. A server-side "
                               "storage fault: the operator must free or fix that storage")
                else:
                    log.exception("engine failed on %s ×%d", group[0].kind, len(group))
                    message = f"engine error in {group[0].kind}: {e}"
                outcomes = [Outcome.failed(message, "server")] * len(group)
            _observe(group[0].kind, len(group), outcomes, time.perf_counter() - started)
            for item, outcome in zip(group, outcomes):
                self._remember(item.key, outcome)
                if self.deliver is not None:
                    sent[item.key] = self.deliver(item.requester, WorkResult(item.key, outcome))

    def _remember(self, key: str, outcome: Outcome) -> None:
        self._answers[key] = outcome
        while len(self._answers) > REMEMBERED_ANSWERS:
            old, _ = self._answers.popitem(last=False)
            self._delivered.discard(old)

    def _run_group(self, kind: str, items: list[WorkItem]) -> list[Outcome]:
        if kind == "forward_backward":
            return self._forward_backward(items)
        if kind == "sample":
            return self._sample(items)
        (item,) = items
        try:
            return [self._single(item)]
        except (InputError, CheckpointError) as e:
            return [Outcome.failed(str(e), "user")]

    def _single(self, item: WorkItem) -> Outcome:
        p = item.params
        if item.kind == "create_adapter":
            self.engine.create_adapter(item.slot, LoraConfig(
                rank=int(p["rank"]), seed=p.get("seed"), train_attn=p.get("train_attn", True),
                train_mlp=p.get("train_mlp", True), train_unembed=p.get("train_unembed", True)))
            return Outcome(json={"slot": item.slot})
        if item.kind == "free_adapter":
            self.engine.free_adapter(item.slot)
            return Outcome(json={})
        if item.kind == "optim_step":
            metrics = self.engine.optim_step(item.slot, AdamConfig(**p))
            return Outcome(json={"metrics": wire.optim_step_metrics(metrics), "type": "optim_step"})
        if item.kind == "snapshot":
            self.engine.snapshot(item.slot, p["key"])
            self._snapshots.add(p["key"])
            return Outcome(json={})
        if item.kind in CHECKPOINT_KINDS:
            return self._checkpoint_op(item)
        if item.kind == "drop_snapshots":
            keys = sorted(p["keys"] if "keys" in p else (k for k in self._snapshots if k.startswith(p["prefix"])))
            for key in keys:
                self.engine.drop_snapshot(key)
                self._snapshots.discard(key)
            return Outcome(json={"dropped": len(keys)})
        return Outcome.failed(f"unknown work kind {item.kind!r}", "server")

    def _checkpoint_op(self, item: WorkItem) -> Outcome:
        if self.checkpoints is None:
            return Outcome.failed("this JAX worker has no checkpoint storage configured (--checkpoint-root)", "server")
        p = item.params
        if item.kind == "save_checkpoint":
            manifest = checkpoint_io.save(self.engine, self.checkpoints, item.slot, p["manifest"],
                                          overwrite=bool(p.get("overwrite")),
                                          age_recipients=list(p.get("age_recipients") or []))
            return Outcome(json={"path": manifest.tinker_path, "size_bytes": manifest.size_bytes})
        if item.kind == "load_checkpoint":
            return Outcome(json=checkpoint_io.load(self.engine, self.checkpoints, item.slot, p["path"],
                                                   optimizer=bool(p.get("optimizer"))))
        try:  # load_snapshot: a sample call in this batch names saved weights this worker has not loaded
            checkpoint_io.load_snapshot(self.engine, self.checkpoints, p["path"])
            self._snapshots.add(p["path"])
            self._load_errors.pop(p["path"], None)
        except (InputError, CheckpointError) as e:
            self._load_errors[p["path"]] = str(e)
            raise
        return Outcome(json={})

    def _forward_backward(self, items: list[WorkItem]) -> list[Outcome]:
        def decode(item: WorkItem):
            info = self.engine.info
            bounds = wire.Bounds(max_rows=info.max_position_embeddings, max_cols=info.vocab_size)
            assert item.payload is not None  # the run always sends forward_backward's body by claim check
            return wire.forward_backward_input(wire.parse_forward_backward(self.store.get(item.payload)), item.slot,
                                               bounds)

        def encode(inp, res) -> Outcome:
            tokens = sum(len(d.tokens) for d in inp.data)
            return Outcome(blob=self.store.put(wire.forward_backward_output(res), "results"),
                           json={"loss": float(res.metrics.get("loss:sum", 0.0)), "tokens": tokens})

        return self._one_engine_call(items, decode, self.engine.forward_backward, encode)

    def _sample(self, items: list[WorkItem]) -> list[Outcome]:
        def decode(item: WorkItem):
            snapshot = item.params.get("snapshot")
            if snapshot in self._load_errors:
                raise InputError(f"could not load sampler weights {snapshot}: {self._load_errors[snapshot]}")
            if snapshot and snapshot.startswith("tinker://") and self.checkpoints is not None \
                    and self.engine.snapshot_evicted(snapshot):
                try:  # saved weights the snapshot budget pushed out: read them again (ephemeral ones fail clearly)
                    checkpoint_io.load_snapshot(self.engine, self.checkpoints, snapshot)
                except (InputError, CheckpointError) as e:
                    raise InputError(f"could not reload sampler weights {snapshot}: {e}") from e
            assert item.payload is not None  # the session always sends the sample request by claim check
            return wire.sample_input(self.store.get(item.payload), snapshot)

        def encode(_inp, res) -> Outcome:
            return Outcome(blob=self.store.put(wire.sample_output(res), "results"),
                           json={"tokens": sum(len(s.tokens) for s in res.sequences)})

        return self._one_engine_call(items, decode, self.engine.sample, encode)

    @staticmethod
    def _one_engine_call(items: list[WorkItem], decode, run, encode) -> list[Outcome]:
        """Decode each item (a bad one fails alone), run the rest in ONE engine call, encode each answer."""
        outcomes: list[Outcome | None] = [None] * len(items)
        inputs, positions = [], []
        for n, item in enumerate(items):
            try:
                inputs.append(decode(item))
                positions.append(n)
            except InputError as e:
                outcomes[n] = Outcome.failed(str(e), "user")
        results = run(inputs) if inputs else []
        for n, inp, res in zip(positions, inputs, results):
            if isinstance(res, Exception):
                outcomes[n] = Outcome.failed(str(res), "user" if isinstance(res, InputError) else "server")
            else:
                outcomes[n] = encode(inp, res)
        return cast(list[Outcome], outcomes)  # every position was filled: by decode's error or by run's result
