"""The JAX worker's side of per-run metric points: turn an engine answer into a point of its run (run_metrics.py).

Training items carry their op's `seq_id` and the run's step (the run workflow tags them); an item without a seq_id
(a recovery replaying logged ops) records nothing, so a replayed op is not counted twice. A sample call counts
against the run whose sampler weights it sampled: a saved path names its run (`tinker://<run>/...`), an ephemeral
snapshot's run is remembered when this worker takes it. Base-model sampling belongs to no run and is not recorded
(its numbers are in the worker's Prometheus series). Recording is best effort: a store fault is logged, never fails
the op whose answer is already computed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from tinkerflow.common.checkpoints import CheckpointError, TinkerPath
from tinkerflow.common.run_metrics import RunMetricsStore
from tinkerflow.workflows.protocol.messages import WorkItem

log = logging.getLogger(__name__)
In = TypeVar("In")
Out = TypeVar("Out")


class OpPoints:
    def __init__(self, store: RunMetricsStore):
        self.store = store
        self._snapshot_runs: dict[str, str] = {}  # ephemeral snapshot key -> the run it was taken from
        self._lock = threading.Lock()

    def training(self, item: WorkItem, op: str, metrics: Mapping[str, Any]) -> None:
        if item.seq_id is None or not item.model_id:
            return
        self._record(item.model_id, op, f"seq:{item.seq_id}", metrics, seq_id=item.seq_id, step=item.step)

    def sample(self, item: WorkItem, metrics: Mapping[str, Any]) -> None:
        run = self.run_of_snapshot(item.snapshot)
        if run:
            self._record(run, "sample", f"sample:{item.key}", metrics)

    def snapshot_taken(self, item: WorkItem) -> None:
        if item.snapshot and item.model_id and not item.snapshot.startswith("tinker://"):
            with self._lock:
                self._snapshot_runs[item.snapshot] = item.model_id

    def snapshots_dropped(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._snapshot_runs.pop(key, None)

    def run_of_snapshot(self, snapshot: str) -> str:
        """The run whose weights `snapshot` holds ("" for the base model or an unknown snapshot)."""
        if not snapshot:
            return ""
        if snapshot.startswith("tinker://"):
            try:
                return TinkerPath.parse(snapshot).run
            except CheckpointError:
                return ""
        with self._lock:
            return self._snapshot_runs.get(snapshot, "")

    def _record(self, run: str, op: str, key: str, metrics: Mapping[str, Any], **where: Any) -> None:
        try:
            self.store.record(run, op, key, metrics, **where)
        except Exception as e:  # the op's answer stands; its point is lost
            log.warning("could not record the %s metric point of %s (%s): %s", op, run, key, e)


class EngineTimer:
    """Seconds the wrapped engine call took (read by the encoder, after the call)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, call: Callable[[list[In]], list[Out]]) -> Callable[[list[In]], list[Out]]:
        def timed(inputs: list[In]) -> list[Out]:
            started = time.perf_counter()
            try:
                return call(inputs)
            finally:
                self.seconds = time.perf_counter() - started

        return timed
