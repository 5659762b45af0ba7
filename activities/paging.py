"""The JAX worker's side of paging (more training runs than adapter slots): the batch's `page` item run on the
engine, the runs it could not page answered as worker-lost, and the figures as Prometheus series.

The Coordinator decides which runs are resident (workflows/coordinator/paging.py) and puts the moves at the head of the
batch that needs them; Engine.page makes them (workers/engine/training/adapter_paging.py). A move that fails leaves that
run without an adapter here: its later items are answered at once as worker-lost (in this batch, and in a batch the
coordinator queued behind it before it heard), so the run restores its adapter from its latest snapshot and retries,
instead of running on a slot that does not hold it. The run is back once a create or a page-in gives it an adapter
again.

Counters and histograms are for Prometheus's own rate() and quantiles; the console reads one scrape at a time, so
two gauges also carry the last minute's page-ins per second and mean page-in latency."""

from __future__ import annotations

import time
from collections import deque

from tinkerflow.common import metrics
from tinkerflow.workers.engine.interface import EngineApi
from tinkerflow.workers.engine.types import InputError, PageMoves, PageReport
from tinkerflow.workflows.protocol.messages import Outcome, WorkItem

WINDOW_S = 60.0


class Paging:
    def __init__(self, engine: EngineApi, window_s: float = WINDOW_S) -> None:
        self.engine = engine
        self.window_s = window_s
        self.lost: dict[str, str] = {}  # runs a page item could not page, until they have an adapter again: why
        self._ins: deque[tuple[float, float]] = deque()  # (when, seconds) of each recent page-in
        self._started = time.monotonic()
        for direction in ("in", "out"):  # every labelled series exported from the start, at zero
            metrics.PAGE_SECONDS.labels(direction)
            metrics.PAGE_MOVES.labels(direction)
        for tier in ("host", "disk"):
            metrics.PAGE_STORE_BYTES.labels(tier)

    def page(self, item: WorkItem) -> Outcome:
        """A batch's head: the moves the Coordinator asks for, made on the engine."""
        if item.page is None:
            raise InputError("page needs its moves")
        report = self.move(
            PageMoves(
                page_out=tuple((m.slot, m.model_id) for m in item.page.page_out),
                page_in=tuple((m.model_id, m.slot) for m in item.page.page_in),
                drop=tuple(item.page.drop),
            )
        )
        for move in item.page.page_in:  # paged in: back in a slot, whatever an earlier move lost
            if move.model_id not in report.failed:
                self.lost.pop(move.model_id, None)
        self.lost.update(report.failed)
        return Outcome(
            json={
                "failed": dict(report.failed),
                "resident": report.resident,
                "paged": report.paged,
                "out_ms": _ms(report.out_seconds),
                "in_ms": _ms(report.in_seconds),
            }
        )

    def created(self, model_id: str) -> None:
        """A run's adapter was created afresh here (its restore): it is no longer lost."""
        self.lost.pop(model_id, None)

    def drop(self, model_id: str) -> Outcome:
        """A run that ends while paged out: only its page goes."""
        self.move(PageMoves(drop=(model_id,)))
        return Outcome(json={})

    def move(self, moves: PageMoves) -> PageReport:
        report = self.engine.page(moves)
        self.observe(report)
        return report

    def without_lost(self, group: list[WorkItem]) -> tuple[list[WorkItem], list[tuple[WorkItem, Outcome]]]:
        """(the items to run, the answers of those whose run this batch's page item lost)."""
        keep: list[WorkItem] = []
        lost: list[tuple[WorkItem, Outcome]] = []
        for item in group:
            why = self.lost.get(item.model_id) if item.model_id else None
            if why is None:
                keep.append(item)
            else:
                message = f"this JAX worker lost the adapter of {item.model_id}: {why}"
                lost.append((item, Outcome(error=message, category="server", worker_lost=True)))
        return keep, lost

    # --- figures -------------------------------------------------------------------------------------------------

    def observe(self, report: PageReport) -> None:
        now = time.monotonic()
        for seconds in report.out_seconds:
            metrics.PAGE_SECONDS.labels("out").observe(seconds)
        metrics.PAGE_MOVES.labels("out").inc(len(report.out_seconds))
        for seconds, tier in zip(report.in_seconds, report.in_tiers, strict=True):
            metrics.PAGE_SECONDS.labels("in").observe(seconds)
            metrics.PAGE_MOVES.labels("in").inc()
            if tier == "disk":
                metrics.PAGE_INS_FROM_DISK.inc()
            self._ins.append((now, seconds))
        if report.failed:
            metrics.PAGE_FAILURES.inc(len(report.failed))
        metrics.ADAPTER_SLOTS_USED.set(report.resident)
        metrics.ADAPTER_RUNS_PAGED.set(report.paged)
        metrics.PAGE_STORE_BYTES.labels("host").set(report.host_bytes)
        metrics.PAGE_STORE_BYTES.labels("disk").set(report.disk_bytes)
        self.refresh(now)

    def refresh(self, now: float | None = None) -> None:
        """Recompute the last minute's gauges (also as time passes with no paging: they fall to 0)."""
        now = time.monotonic() if now is None else now
        while self._ins and now - self._ins[0][0] > self.window_s:
            self._ins.popleft()
        span = max(1e-9, min(self.window_s, now - self._started))
        metrics.PAGE_INS_PER_SECOND.set(len(self._ins) / span)
        metrics.PAGE_IN_SECONDS_RECENT.set(sum(s for _, s in self._ins) / len(self._ins) if self._ins else 0.0)


def _ms(seconds: tuple[float, ...]) -> list[float]:
    return [round(x * 1e3, 3) for x in seconds]
