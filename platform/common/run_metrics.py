"""Per-run metric points (docs/metrics.md): every training op's numbers and every sample call's counts, kept in the
store.

Who writes: the JAX worker, the moment an engine call answers (it holds the numbers: the loss's metrics, tokens,
grad_norm, the engine's wall time), so recording costs no Temporal round trip and puts nothing in workflow history;
the run workflow only tags each training item with its `seq_id` and the run's step (WorkItem fields).
Who reads: the API's `GET /api/v1/training_runs/{id}/metrics` (routes_run_metrics.py).

Layout: `<store>/run_metrics/<quoted model_id>/<index:012d>.json`, one small JSON object per point. The store is
durable (a local directory or a bucket), so points outlive a restart of any process.

- **Index**: 0-based and increasing per run, assigned by the writer. A local store creates each file exclusively
  (`os.link`), so two writers of one run (its trainer and a worker sampling its saved weights) never share an index;
  an object store cannot create exclusively through fsspec, so there two writers of one run at the same instant
  could collide (one point lost), which we accept for a count of samples.
- **Idempotent**: a point carries a key (`seq:<seq_id>` for training ops, the work item's key for a sample call); a
  key already recorded for the run is not recorded again (an activity retried after its worker died re-runs ops).
- **Bounded**: at most `max_points` files per run (`--run-metrics-max-points`). Past it, the older half is thinned:
  every second point of each op kind there is deleted, so recent points keep full resolution, older ones grow
  coarser, and no kind of point disappears from a range.
- **Non-finite** numbers (NaN, ±inf) are stored and answered as null.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import fsspec

from tinkerflow.common.store import is_local

log = logging.getLogger(__name__)
KIND = "run_metrics"
OPS = ("forward_backward", "forward", "optim_step", "sample")
DEFAULT_MAX_POINTS = 2000
_SUFFIX = ".json"


def finite_or_none(value: Any) -> float | None:
    """A metric value as JSON can carry it: a finite float, else null (NaN and ±inf are not JSON)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


@dataclass(frozen=True)
class MetricPoint:
    index: int
    op: str
    seq_id: int | None
    step: int
    time: float
    metrics: dict[str, float | None]
    key: str = ""  # idempotency key, stored but not answered

    def as_json(self) -> dict[str, Any]:
        """The point as the metrics route answers it (the shared contract's shape)."""
        return {
            "index": self.index,
            "op": self.op,
            "seq_id": self.seq_id,
            "step": self.step,
            "time": self.time,
            "metrics": dict(self.metrics),
        }

    def to_bytes(self) -> bytes:
        return json.dumps({**self.as_json(), "key": self.key}, allow_nan=False).encode()

    @staticmethod
    def from_bytes(data: bytes) -> MetricPoint:
        d = json.loads(data)
        seq = d.get("seq_id")
        return MetricPoint(
            index=int(d["index"]),
            op=str(d["op"]),
            seq_id=None if seq is None else int(seq),
            step=int(d.get("step", 0)),
            time=float(d.get("time", 0.0)),
            metrics={str(k): finite_or_none(v) for k, v in (d.get("metrics") or {}).items()},
            key=str(d.get("key", "")),
        )


@dataclass(frozen=True)
class MetricsPage:
    points: list[MetricPoint]
    next_after: int | None
    total_points: int


@dataclass
class _RunLog:
    """What one writer process knows of one run's points (loaded from the store on first use)."""

    files: dict[int, tuple[str, str]] = field(default_factory=dict[int, tuple[str, str]])  # index -> (op, key)
    keys: set[str] = field(default_factory=set[str])
    next_index: int = 0
    last_step: int = 0


def _index_of(name: str) -> int | None:
    base = name.rsplit("/", 1)[-1]
    if not base.endswith(_SUFFIX):
        return None  # a `.partial` being written, or something that is not ours
    try:
        return int(base[: -len(_SUFFIX)])
    except ValueError:
        return None


def _read_local(paths: list[str]) -> dict[str, bytes]:
    """Plain file reads: about ten times faster than fsspec's per-file overhead for a page of small points."""
    out: dict[str, bytes] = {}
    for path in paths:
        try:
            with open(path, "rb") as f:
                out[path] = f.read()
        except FileNotFoundError:
            pass
    return out


class RunMetricsStore:
    """Reads and writes the points of every run under `<store url>/run_metrics/`. Thread-safe within a process."""

    def __init__(self, url: str, max_points: int = DEFAULT_MAX_POINTS):
        if max_points < 2:
            raise ValueError(f"--run-metrics-max-points must be at least 2 (got {max_points})")
        self.url = url.rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(self.url)
        self.root = f"{root}/{KIND}"
        self.max_points = max_points
        self._local = is_local(self.fs)
        self._lock = threading.Lock()
        self._runs: dict[str, _RunLog] = {}

    def run_dir(self, model_id: str) -> str:
        return f"{self.root}/{quote(model_id, safe='')}"

    def _path(self, model_id: str, index: int) -> str:
        return f"{self.run_dir(model_id)}/{index:012d}{_SUFFIX}"

    # --- reading --------------------------------------------------------------------------------------------------

    def _indices(self, model_id: str) -> list[int]:
        try:  # a local directory: names only (fsspec's local ls also stats every entry)
            names = (
                os.listdir(self.run_dir(model_id)) if self._local else self.fs.ls(self.run_dir(model_id), detail=False)
            )
        except FileNotFoundError:
            return []
        return sorted(i for i in (_index_of(str(n)) for n in names) if i is not None)

    def _read(self, model_id: str, indices: list[int]) -> list[MetricPoint]:
        if not indices:
            return []
        paths = [self._path(model_id, i) for i in indices]
        # A point thinned away between the listing and this read is simply not answered (on_error="omit").
        blobs = _read_local(paths) if self._local else self.fs.cat(paths, on_error="omit")
        points: list[MetricPoint] = []
        for path in paths:
            data = blobs.get(path) if isinstance(blobs, dict) else None
            if isinstance(data, bytes):
                try:
                    points.append(MetricPoint.from_bytes(data))
                except (ValueError, KeyError) as e:
                    log.warning("skipping unreadable metric point %s: %s", path, e)
        return points

    def page(self, model_id: str, after: int = -1, limit: int = 1000) -> MetricsPage:
        """Points with index > `after`, oldest first, at most `limit`; `next_after` is None when none remain."""
        indices = self._indices(model_id)
        newer = [i for i in indices if i > after]
        chosen = newer[:limit]
        points = self._read(model_id, chosen)
        more = len(newer) > len(chosen)
        return MetricsPage(points=points, next_after=chosen[-1] if more and chosen else None, total_points=len(indices))

    # --- writing --------------------------------------------------------------------------------------------------

    def _load(self, model_id: str) -> _RunLog:
        run = self._runs.get(model_id)
        if run is None:
            run = _RunLog()
            for p in self._read(model_id, self._indices(model_id)):
                run.files[p.index] = (p.op, p.key)
                run.keys.add(p.key)
                run.next_index = max(run.next_index, p.index + 1)
                run.last_step = p.step
            self._runs[model_id] = run
        return run

    def record(
        self,
        model_id: str,
        op: str,
        key: str,
        metrics: Mapping[str, Any],
        *,
        seq_id: int | None = None,
        step: int | None = None,
        now: float | None = None,
    ) -> MetricPoint | None:
        """Record one point for `model_id`; None when `key` is already recorded (a retry). `step` None: the run's
        step as of its latest point (sample calls do not know it)."""
        if op not in OPS:
            raise ValueError(f"unknown op {op!r} (one of {', '.join(OPS)})")
        with self._lock:
            run = self._load(model_id)
            if key in run.keys:
                return None
            values = {str(k): finite_or_none(v) for k, v in metrics.items()}
            stamp = time.time() if now is None else now
            while True:
                point = MetricPoint(
                    index=run.next_index,
                    op=op,
                    seq_id=seq_id,
                    step=run.last_step if step is None else step,
                    time=stamp,
                    metrics=values,
                    key=key,
                )
                if self._create(model_id, point):
                    break
                # Another writer took this index: learn what it wrote, then take the next free one.
                self._runs.pop(model_id, None)
                run = self._load(model_id)
                if key in run.keys:
                    return None
            run.files[point.index] = (op, key)
            run.keys.add(key)
            run.next_index = point.index + 1
            run.last_step = point.step
            if len(run.files) > self.max_points:
                self._thin(model_id, run)
            return point

    def _create(self, model_id: str, point: MetricPoint) -> bool:
        """Write the point's file; False when its index is already taken (local stores only can tell)."""
        path = self._path(model_id, point.index)
        self.fs.makedirs(self.run_dir(model_id), exist_ok=True)
        data = point.to_bytes()
        if not self._local:
            with self.fs.open(path, "wb") as f:
                f.write(data)
            return True
        partial = f"{path}.{uuid.uuid4().hex}.partial"
        with open(partial, "wb") as f:
            f.write(data)
        try:
            os.link(partial, path)  # atomic, and fails when the name exists: exclusive creation
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(partial)

    def _thin(self, model_id: str, run: _RunLog) -> None:
        """Delete every second point of each op kind in the older half of the run's points."""
        ordered = sorted(run.files)
        older = ordered[: len(ordered) // 2]
        seen: dict[str, int] = {}
        doomed: list[int] = []
        for index in older:
            op = run.files[index][0]
            seen[op] = seen.get(op, 0) + 1
            if seen[op] % 2 == 0:
                doomed.append(index)
        if not doomed:  # each kind appears once there (a tiny bound): drop the newest of the older half
            doomed = [older[-1]]
        for index in doomed:
            try:
                self.fs.rm(self._path(model_id, index))
            except FileNotFoundError:
                pass
            _, key = run.files.pop(index)
            run.keys.discard(key)
        log.debug("thinned %d old metric points of %s", len(doomed), model_id)
