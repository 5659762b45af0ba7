"""Reading the metering ledgers as they grow, every `--ledger-read-s`: one road that feeds both the quota tally
(quota_tally.py) and the per-tenant usage counters of /metrics, so a Grafana panel and a quota refusal never disagree
about what a tenant used.

The ledgers are the ones the billing routes read (usage_data.py): each training run's `usage` query, and each closed
SampleRequest workflow's memo. A read asks only for what may have grown since the previous one: the runs that are
live or closed since then (a run's ledger is kept by hour, and only the current hour grows), and the sample batches
closed since then, less those already read; MARGIN covers what Temporal's visibility shows late. The first read
finds the day's usage so far: it seeds the tally and is the counters' baseline (a counter counts from the process's
start, as Prometheus counters do). With several API replicas each reads the same ledgers: aggregate the counters
with max by (tenant), not sum.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta

from temporalio.client import Client

from tinkerflow.api.quota_tally import UsageTally
from tinkerflow.api.usage_data import day_start, visibility_time
from tinkerflow.common.metrics import (
    LEDGER_READS,
    TENANT_PROMPT_TOKENS,
    TENANT_SAMPLED_TOKENS,
    TENANT_TRAINING_TOKENS,
)
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.usage import OpUsage, hour_of, ledger_from_memo
from tinkerflow.workflows.training_run import TrainingRunWorkflow

log = logging.getLogger(__name__)
MARGIN = timedelta(minutes=5)


@dataclass(frozen=True)
class LedgerRead:
    seeding: bool  # the first read: the day's usage so far, not what grew meanwhile
    grown: dict[tuple[str, str], OpUsage]  # (tenant, hour) -> what the ledgers gained
    closed: set[str]  # SampleRequest workflows read closed for the first time


def _minus(a: OpUsage, b: OpUsage) -> OpUsage:
    return OpUsage(**{f.name: max(0, getattr(a, f.name) - getattr(b, f.name)) for f in fields(OpUsage)})


class LedgerWatch:
    def __init__(self, client: Client):
        self._client = client
        self._runs: dict[tuple[str, str], OpUsage] = {}  # (run workflow id, hour) -> its ledger's bucket, as read
        self._samples: dict[str, datetime] = {}  # sample batches read, by close time
        self._cursor: datetime | None = None  # when the last read began

    async def read(self, now: datetime) -> LedgerRead:
        """What the ledgers gained since the last read. A read that fails changes nothing: the next one covers it."""
        seeding = self._cursor is None
        since = day_start(now) if self._cursor is None else self._cursor - MARGIN
        oldest = hour_of(min(since, now - MARGIN))  # older buckets no longer grow
        grown: dict[tuple[str, str], OpUsage] = {}
        runs = dict(self._runs)
        query = (
            "WorkflowType = 'TrainingRun' AND ExecutionStatus != 'ContinuedAsNew' AND "
            f"(ExecutionStatus = 'Running' OR CloseTime >= '{visibility_time(since)}')"
        )
        async for wf in self._client.list_workflows(query):
            try:
                ledger = await self._client.get_workflow_handle(wf.id, run_id=wf.run_id).query(
                    TrainingRunWorkflow.usage
                )
            except Exception as e:  # a run that cannot answer now is read again next time
                log.debug("ledger: %s did not answer its usage query: %s", wf.id, e)
                continue
            tenant = wf.typed_search_attributes.get(names.OWNER) or "open"
            for hour, usage in ledger.items():
                if hour >= oldest:
                    _add(grown, (tenant, hour), _minus(usage, runs.get((wf.id, hour), OpUsage())))
                    runs[(wf.id, hour)] = usage
        samples = dict(self._samples)
        closed: set[str] = set()
        async for wf in self._client.list_workflows(
            f"WorkflowType = 'SampleRequest' AND CloseTime >= '{visibility_time(since)}'"
        ):
            if wf.id in samples:
                continue
            samples[wf.id] = wf.close_time or now
            closed.add(wf.id)
            tenant = wf.typed_search_attributes.get(names.OWNER) or "open"
            for hour, usage in ledger_from_memo((await wf.memo()).get("usage")).items():
                _add(grown, (tenant, hour), usage)
        self._runs = {k: v for k, v in runs.items() if k[1] >= oldest}
        self._samples = {k: t for k, t in samples.items() if t >= since}
        self._cursor = now
        return LedgerRead(seeding, grown, closed)


def _add(grown: dict[tuple[str, str], OpUsage], key: tuple[str, str], usage: OpUsage) -> None:
    if usage:
        grown[key] = grown.get(key, OpUsage()) + usage


def apply(read: LedgerRead, tally: UsageTally, now: datetime) -> None:
    """Hand a read to the tally, and what grew (not the seed) to the per-tenant counters."""
    for (tenant, hour), usage in read.grown.items():
        tally.metered(tenant, hour, usage, seeding=read.seeding)
        if not read.seeding:
            _count(tenant, usage)
    tally.closed(read.closed)
    tally.prune((now.astimezone(UTC).date() - timedelta(days=1)).isoformat())


def _count(tenant: str, u: OpUsage) -> None:
    for counter, value in (
        (TENANT_TRAINING_TOKENS.labels(tenant), u.training_tokens),
        (TENANT_PROMPT_TOKENS.labels(tenant, "true"), u.prefill_cached_tokens),
        (TENANT_PROMPT_TOKENS.labels(tenant, "false"), u.prefill_uncached_tokens),
        (TENANT_SAMPLED_TOKENS.labels(tenant), u.sampled_tokens),
    ):
        if value > 0:
            counter.inc(value)


async def watch(client: Client, tally: UsageTally, interval_s: float, seeded: asyncio.Event) -> None:
    """Read the ledgers every `interval_s` for as long as the API runs; `seeded` is set after the first read."""
    reader, failing = LedgerWatch(client), False
    while True:
        now = datetime.now(UTC)
        try:
            apply(await reader.read(now), tally, now)
        except Exception as e:
            LEDGER_READS.labels("error").inc()
            (log.debug if failing else log.warning)(
                "ledger read failed (%s); quota tallies and per-tenant usage counters catch up on the next one", e
            )
            failing = True
        else:
            LEDGER_READS.labels("ok").inc()
            seeded.set()
            failing = False
        await asyncio.sleep(interval_s)
