"""The JAX workers' own Prometheus /metrics, read for the console's service panel: tokens/s per batch kind, and MFU and
device memory where the worker exports them. The Coordinator's query knows slots and queues but not throughput, which
only the engine measures; reading the exposition the worker already serves needs no workflow change.

Where to read: --worker-metrics-urls, else the one worker `tinkerflow up` runs when it serves /metrics
(--metrics-port on --host). Answers are cached for a moment so a page of polling browsers costs one scrape.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tinkerflow.common.settings import Settings

log = logging.getLogger(__name__)
SCRAPE_TIMEOUT_S = 2.0
CACHE_S = 2.0
# metric family (as the parser names it: counters lose their _total) -> what the console calls it
GAUGES_BY_KIND = {
    "tinkerflow_engine_tokens_per_second": "tokens_per_second",
    "tinkerflow_engine_mfu": "mfu",
}
# the device-memory plan: {family: (console key, label)}
MEMORY_PLAN = {
    "tinkerflow_memory_plan_bytes": ("memory_plan_bytes", "part"),
    "tinkerflow_memory_plan_max_tokens": ("memory_plan_max_tokens", "op"),
}
# Paging (more runs than slots): the last minute's page-ins per second and mean page-in seconds, and what is paged.
PAGING = {
    "tinkerflow_adapter_page_ins_per_second": "page_ins_per_second",
    "tinkerflow_adapter_page_in_seconds_recent": "page_in_seconds_recent",
    "tinkerflow_adapter_runs_paged": "runs_paged",
    "tinkerflow_adapter_slots_used": "slots_resident",
}
DEVICE_SUMS = {
    "tinkerflow_device_memory_in_use_bytes": "device_memory_in_use_bytes",
    "tinkerflow_device_memory_peak_bytes": "device_memory_peak_bytes",
    "tinkerflow_device_memory_limit_bytes": "device_memory_limit_bytes",
}


def worker_metrics_urls(settings: Settings) -> tuple[str, ...]:
    if settings.worker_metrics_urls:
        return settings.worker_metrics_urls
    if settings.metrics_port:
        host = "127.0.0.1" if settings.host in ("", "0.0.0.0", "::") else settings.host
        return (f"http://{host}:{settings.metrics_port}/metrics",)
    return ()


def summarize(exposition: str) -> dict:
    """What the console shows of one worker's exposition: {tokens_per_second: {kind: v}, mfu: {kind: v},
    device_memory_*_bytes: summed over devices, memory_plan_bytes: {part: v}, memory_plan_max_tokens: {op: v}, and
    the paging figures}; absent families are absent keys, non-finite values dropped."""
    out: dict = {}
    for family in text_string_to_metric_families(exposition):
        if family.name in GAUGES_BY_KIND:
            per_kind = out.setdefault(GAUGES_BY_KIND[family.name], {})
            for s in family.samples:
                if math.isfinite(s.value):
                    per_kind[s.labels.get("kind", "")] = s.value
        elif family.name in MEMORY_PLAN:
            key, label = MEMORY_PLAN[family.name]
            for s in family.samples:
                if math.isfinite(s.value):
                    out.setdefault(key, {})[s.labels.get(label, "")] = s.value
        elif family.name in PAGING:
            values = [s.value for s in family.samples if math.isfinite(s.value)]
            if values:
                out[PAGING[family.name]] = sum(values)
        elif family.name in DEVICE_SUMS:
            values = [s.value for s in family.samples if math.isfinite(s.value)]
            if values:
                out[DEVICE_SUMS[family.name]] = sum(values)
    return out


@dataclass
class WorkerMetrics:
    urls: tuple[str, ...]
    _cached: tuple[float, list[dict]] | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def read(self) -> list[dict]:
        """One entry per configured worker: its summary, or {"answered": False} when it did not answer."""
        async with self._lock:
            if self._cached is not None and time.monotonic() - self._cached[0] < CACHE_S:
                return self._cached[1]
            async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_S) as http:
                answers = await asyncio.gather(*(self._one(http, u) for u in self.urls))
            self._cached = (time.monotonic(), answers)
            return answers

    @staticmethod
    async def _one(http: httpx.AsyncClient, url: str) -> dict:
        try:
            r = await http.get(url)
            r.raise_for_status()
            return {"answered": True, **summarize(r.text)}
        except (httpx.HTTPError, ValueError) as e:  # a worker restarting, or not a Prometheus exposition
            log.debug("worker metrics at %s: %s", url, e)  # the URL is the operator's, never shown to callers
            return {"answered": False}
