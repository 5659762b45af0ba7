"""The JAX worker's one activity, `run_batch`: execute a coordinator batch on the engine, in order.

Consecutive forward_backward items run as ONE engine call (one pass over many adapters' examples), consecutive
sample items as one decode batch. Inputs and results cross through the claim-check store; only refs come back.
A batch Temporal retries after a transient failure does not re-apply work this process already did: answers are
remembered by item key.

Each answer goes home on one road: signalled straight to the workflow that asked (`deliver`), the moment its group
is done, which saves the requester a coordinator workflow task and a second signal hop (docs/benchmarks.md
§Measurements behind the code). The batch result tells the coordinator only what its bookkeeping reads (which items
failed, and the page item's report); an answer whose signal did not go through travels in it whole, for the
coordinator to deliver instead.

Batches run one at a time, in the order the coordinator dispatched them (batch_order.py: pipelined dispatch)."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from itertools import groupby
from typing import Any

from temporalio import activity
from temporalio.exceptions import ApplicationError, CancelledError

from tinkerflow.activities import checkpoint_io, stability_checks, wire
from tinkerflow.activities.accelerator_metrics import AcceleratorMeter
from tinkerflow.activities.answers import Answers
from tinkerflow.activities.batch_order import BatchCancelled, BatchOrder
from tinkerflow.activities.heartbeats import HEARTBEAT_EVERY_S, heartbeats
from tinkerflow.activities.item_calls import failure_message, one_engine_call, payload, single
from tinkerflow.activities.op_points import EngineTimer, OpPoints
from tinkerflow.activities.paging import Paging
from tinkerflow.activities.sampler_weights import SamplerWeights
from tinkerflow.activities.specs import lora_config, optim_config
from tinkerflow.activities.wire_images import ImageRules
from tinkerflow.common import metrics
from tinkerflow.common.checkpoints import CheckpointStore
from tinkerflow.common.store import ClaimCheckStore
from tinkerflow.workers.engine.interface import EngineApi
from tinkerflow.workers.engine.types import (
    ForwardBackwardInput,
    ForwardBackwardResult,
    InputError,
    SampleInput,
    SampleResult,
)
from tinkerflow.workflows.protocol.error_types import ErrorType
from tinkerflow.workflows.protocol.messages import Batch, BatchResult, Outcome, WorkItem, WorkKind, WorkResult
from tinkerflow.workflows.protocol.usage import OpUsage

log = logging.getLogger(__name__)
# Kinds whose consecutive items run as ONE engine call (one pass over many adapters, one decode batch).
GROUPED_KINDS = {WorkKind.FORWARD_BACKWARD, WorkKind.SAMPLE}
CHECKPOINT_KINDS = {WorkKind.SAVE_CHECKPOINT, WorkKind.LOAD_CHECKPOINT, WorkKind.LOAD_SNAPSHOT}
# callable(requester workflow id, WorkResult) -> concurrent.futures.Future of the signal
Deliver = Callable[[str, WorkResult], concurrent.futures.Future[Any]]


def _observe(kind: WorkKind, n: int, outcomes: list[Outcome], seconds: float) -> int:  # the tokens processed
    label = kind.value
    metrics.ENGINE_OP_SECONDS.labels(label).observe(seconds)
    metrics.BATCH_ITEMS.labels(label).observe(n)
    tokens = sum(int((o.json or {}).get("tokens", 0)) for o in outcomes if o.ok)
    if tokens:
        metrics.ENGINE_TOKENS.labels(label).inc(tokens)
        metrics.ENGINE_TOKENS_PER_S.labels(label).set(tokens / max(seconds, 1e-9))
    if kind in (WorkKind.CREATE_ADAPTER, WorkKind.FREE_ADAPTER):
        ok = sum(1 for o in outcomes if o.ok)
        metrics.ADAPTER_SLOTS_USED.inc(ok if kind is WorkKind.CREATE_ADAPTER else -ok)
    return tokens


class EngineActivities:
    def __init__(
        self,
        engine: EngineApi,
        store: ClaimCheckStore,
        deliver: Deliver | None = None,
        checkpoints: CheckpointStore | None = None,
        incarnation: str = "",
        points: OpPoints | None = None,
        meter: AcceleratorMeter | None = None,
        images: ImageRules | None = None,
    ):
        self.engine = engine
        self.images = images  # how datums' and prompts' ImageChunks become tokens and patches (None: refused)
        self.points, self.meter = points, meter  # each op's metric point; device memory and MFU per engine call
        self.incarnation = incarnation
        self.store = store
        self.checkpoints = checkpoints
        self.deliver = deliver
        self.answers = Answers()  # by item key: a retried batch re-applies nothing this process did
        self.sampler_weights = SamplerWeights(engine, store, checkpoints)  # taken, kept, reloaded when lost
        self.paging = Paging(engine)  # more runs than slots: the batch's page item (activities/paging.py)
        self.order = BatchOrder()  # one batch at a time, in dispatch order
        # One handler per kind. Grouped kinds take the whole run of consecutive items; the others one item each.
        self.handlers: dict[WorkKind, Callable[[list[WorkItem]], list[Outcome]]] = {
            WorkKind.FORWARD_BACKWARD: self._forward_backward,
            WorkKind.SAMPLE: self._sample,
            WorkKind.CREATE_ADAPTER: single(self._create_adapter),
            WorkKind.FREE_ADAPTER: single(self._free_adapter),
            WorkKind.OPTIM_STEP: single(self._optim_step),
            WorkKind.SNAPSHOT: single(self._snapshot),
            WorkKind.DROP_SNAPSHOTS: single(self._drop_snapshots),
            WorkKind.SAVE_CHECKPOINT: single(self._checkpoint(self._save_checkpoint)),
            WorkKind.LOAD_CHECKPOINT: single(self._checkpoint(self._load_checkpoint)),
            WorkKind.LOAD_SNAPSHOT: single(self._load_snapshot),
            WorkKind.PAGE: single(self.paging.page),
        }

    @activity.defn(name="run_batch")
    def run_batch(self, batch: Batch) -> BatchResult:
        if batch.incarnation and self.incarnation and batch.incarnation != self.incarnation:
            # A retry of a batch placed on this worker's previous process: the slots it names are not ours.
            raise ApplicationError(
                f"this batch was placed on an earlier process of this JAX worker "
                f"({batch.incarnation[:8]}, now {self.incarnation[:8]}), which died or restarted",
                type=ErrorType.WORKER_LOST,
                non_retryable=True,
            )
        sent: dict[str, concurrent.futures.Future[Any]] = {}
        with heartbeats(HEARTBEAT_EVERY_S) as progress:
            if batch.after:
                progress[0] = f"waiting for batch {batch.after}"
            try:
                with self.order.turn(batch.batch_id, batch.after, activity.is_cancelled):
                    todo = [i for i in batch.items if i.key not in self.answers]
                    self._run_items(todo, sent, progress)
                    answers = [(i.key, self.answers[i.key]) for i in batch.items]
            except BatchCancelled as e:
                raise CancelledError(str(e)) from e
        for key, future in sent.items():  # only a confirmed delivery lets the coordinator skip its own
            try:
                future.result(timeout=10)
                self.answers.delivered(key)
            except Exception as e:
                log.info("early delivery of %s failed (%s); the coordinator will deliver it", key, e)
        return BatchResult(results=[self.answers.for_coordinator(key, outcome) for key, outcome in answers])

    def _run_items(
        self, todo: list[WorkItem], sent: dict[str, concurrent.futures.Future[Any]], progress: list[str]
    ) -> None:
        for _, run in groupby(todo, key=lambda i: i.kind if i.kind in GROUPED_KINDS else i.key):
            group, lost = self.paging.without_lost(list(run))
            for item, outcome in lost:
                self._answered(item, outcome, sent)
            if not group:
                continue
            progress[0] = f"{group[0].kind} ×{len(group)}"
            started = time.perf_counter()
            try:
                outcomes = self._run_group(group[0].kind, group)
            except Exception as e:  # an engine bug must not take the other requests of the batch with it
                store = (
                    ("checkpoint", self.checkpoints.url)
                    if group[0].kind in CHECKPOINT_KINDS and self.checkpoints is not None
                    else ("claim-check", self.store.url)
                )
                message, fault = failure_message(group[0].kind, e, store)
                if fault:
                    log.error("%s ×%d: %s", group[0].kind, len(group), fault)
                else:
                    log.exception("engine failed on %s ×%d", group[0].kind, len(group))
                outcomes = [Outcome.failed(message, "server")] * len(group)
            tokens = _observe(group[0].kind, len(group), outcomes, seconds := time.perf_counter() - started)
            if self.meter is not None:
                self.meter.observe(group[0].kind.value, tokens, seconds)
            for item, outcome in zip(group, outcomes):
                self._answered(item, outcome, sent)

    def _answered(self, item: WorkItem, outcome: Outcome, sent: dict[str, concurrent.futures.Future[Any]]) -> None:
        self.answers.remember(item.key, outcome)
        if self.deliver is not None and item.kind is not WorkKind.PAGE:  # the Coordinator reads that in the result
            sent[item.key] = self.deliver(item.requester, WorkResult(item.key, outcome))

    def _run_group(self, kind: WorkKind, items: list[WorkItem]) -> list[Outcome]:
        handler = self.handlers.get(kind)
        if handler is None:
            return [Outcome.failed(f"unknown work kind {kind!r}", "server")] * len(items)
        return handler(items)

    def _checkpoint(self, handle: Callable[[WorkItem], Outcome]) -> Callable[[WorkItem], Outcome]:
        def run(item: WorkItem) -> Outcome:
            if self.checkpoints is None:
                return Outcome.failed(
                    "this JAX worker has no checkpoint storage configured (--checkpoint-root)", "server"
                )
            return handle(item)

        return run

    def _create_adapter(self, item: WorkItem) -> Outcome:
        if item.lora is None:
            raise InputError("create_adapter needs a LoRA spec")
        self.engine.create_adapter(item.slot, lora_config(item.lora))
        self.paging.created(item.model_id)
        return Outcome(json={"slot": item.slot})

    def _free_adapter(self, item: WorkItem) -> Outcome:
        if item.slot < 0:  # a run that ends while paged out
            return self.paging.drop(item.model_id)
        self.engine.free_adapter(item.slot)
        return Outcome(json={})

    def _optim_step(self, item: WorkItem) -> Outcome:
        if item.adam is None:
            raise InputError("optim_step needs adam_params")
        started = time.perf_counter()
        step_metrics = self.engine.optim_step(item.slot, optim_config(item.adam))
        if self.points is not None:
            point = {"grad_norm": step_metrics.get("grad_norm"), "learning_rate": item.adam.learning_rate}
            self.points.training(item, "optim_step", {**point, "wall_s": time.perf_counter() - started})
        return Outcome(json={"metrics": wire.optim_step_metrics(step_metrics), "type": "optim_step"})

    def _snapshot(self, item: WorkItem) -> Outcome:
        self.sampler_weights.take(item.slot, item.snapshot)
        if self.points is not None:
            self.points.snapshot_taken(item)
        return Outcome(json={})

    def _drop_snapshots(self, item: WorkItem) -> Outcome:
        # The Coordinator resolves a session's prefix into keys from its record (the one record of snapshots). A
        # prefix-only item can only be a batch an older Coordinator dispatched before an upgrade: nothing to name.
        keys = sorted(item.drop.keys or []) if item.drop is not None else []
        if item.drop is not None and item.drop.keys is None:
            log.warning(
                "drop_snapshots %s names a prefix (%r) and no keys; nothing dropped", item.key, item.drop.prefix
            )
        self.sampler_weights.drop(keys, item.drop.prefix if item.drop is not None else "")
        if self.points is not None:
            self.points.snapshots_dropped(keys)
        return Outcome(json={"dropped": len(keys)})

    def _checkpoint_store(self) -> CheckpointStore:
        # The worker passes one whenever it serves checkpoint work.
        assert self.checkpoints is not None, "checkpoint work needs EngineActivities(checkpoints=...)"
        return self.checkpoints

    def _save_checkpoint(self, item: WorkItem) -> Outcome:
        save = item.save
        if save is None:
            raise InputError("save_checkpoint needs a path and a manifest")
        manifest = checkpoint_io.save(
            self.engine,
            self._checkpoint_store(),
            item.slot,
            save.manifest,
            overwrite=save.overwrite,
            age_recipients=list(save.age_recipients),
        )
        # Metered here, with the answer; the run counts it unless it is an automatic snapshot (run_checkpoints.py).
        usage = OpUsage(checkpoints=1, checkpoint_bytes=manifest.size_bytes)
        return Outcome(json={"path": manifest.tinker_path, "size_bytes": manifest.size_bytes}, usage=usage)

    def _load_checkpoint(self, item: WorkItem) -> Outcome:
        if item.load is None:
            raise InputError("load_checkpoint needs a path")
        return Outcome(
            json=checkpoint_io.load(
                self.engine, self._checkpoint_store(), item.slot, item.load.path, optimizer=item.load.optimizer
            )
        )

    def _load_snapshot(self, item: WorkItem) -> Outcome:
        """A sample call in this batch names sampler weights this worker does not hold: saved ones (a path), or an
        ephemeral snapshot whose worker died or whose memory copy was collected (its key)."""
        if item.load is None:
            raise InputError("load_snapshot needs a path")
        self.sampler_weights.load(item.load.path)
        return Outcome(json={})

    def _forward_backward(self, items: list[WorkItem]) -> list[Outcome]:
        asked: dict[int, WorkItem] = {}  # id(decoded input) -> its item, for its metric point
        timer = EngineTimer()

        def decode(item: WorkItem) -> ForwardBackwardInput:
            info = self.engine.info
            bounds = wire.Bounds(max_rows=info.max_position_embeddings, max_cols=info.vocab_size)
            msg = wire.parse_forward_backward(self.store.get(payload(item)))  # stable_reinforce: checked, recorded
            inp = stability_checks.resolve(
                self.store, msg, wire.forward_backward_input(msg, item.slot, bounds, self.images), item.model_id
            )
            asked[id(inp)] = item
            return inp

        def encode(inp: ForwardBackwardInput, res: ForwardBackwardResult) -> Outcome:
            tokens = sum(len(d.tokens) for d in inp.data)
            if self.points is not None:  # wall_s: the one engine call this op shared with the others batched in it
                op = "forward" if inp.forward_only else "forward_backward"
                point = {**res.metrics, "tokens": tokens, "wall_s": timer.seconds}
                self.points.training(asked[id(inp)], op, point)
            return Outcome(
                blob=self.store.put(wire.forward_backward_output(res), "results"),
                json={"loss": float(res.metrics.get("loss:sum", 0.0)), "tokens": tokens},
                usage=OpUsage(training_tokens=tokens),
            )

        return one_engine_call(items, decode, timer.wrap(self.engine.forward_backward), encode)

    def _sample(self, items: list[WorkItem]) -> list[Outcome]:
        asked: dict[int, tuple[WorkItem, bytes]] = {}  # the item and its SampleRequest body
        timer = EngineTimer()

        def decode(item: WorkItem) -> SampleInput:
            snapshot = item.snapshot or None
            self.sampler_weights.ready(item.snapshot)  # a failed load's error, or weights the budget pushed out
            body = self.store.get_unless_cancelled(payload(item))  # cancel_future marks queued samples
            inp = wire.sample_input(body, snapshot, self.images)
            asked[id(inp)] = (item, body)
            return inp

        def encode(inp: SampleInput, res: SampleResult) -> Outcome:
            tokens, (item, body) = sum(len(s.tokens) for s in res.sequences), asked[id(inp)]
            if self.points is not None:
                point = {"num_samples": len(res.sequences), "tokens_generated": tokens, "wall_s": timer.seconds}
                self.points.sample(item, point)
            stability_checks.record(self.store, item, body, res)  # asked with record_stability_info: before the answer
            # The prompt is prefilled once for all its samples; the engine says how much of it the prefix cache held.
            prompt = len(inp.prompt)
            cached = min(res.prompt_cache_hit_tokens, prompt)
            usage = OpUsage(prefill_tokens=prompt, prefill_cached_tokens=cached, sampled_tokens=tokens)
            blob = self.store.put(wire.sample_output(res, body), "results")
            return Outcome(blob=blob, json={"tokens": tokens}, usage=usage)

        return one_engine_call(items, decode, timer.wrap(self.engine.sample), encode)
