"""Reading the metered usage and the derived audit events back: from the ledgers the workflows keep
(workflows/protocol/usage.py), the checkpoint manifests and Temporal's visibility. Nothing here writes.

- Training runs: one visibility listing of the tenant's runs (the latest execution of each: a run carries its
  ledger across continue-as-new), then the `usage` query of each run that could hold usage in the window.
- Sampling: one visibility listing of the tenant's SampleRequest workflows; each carries its usage in its memo.
- Storage: the tenant's current checkpoints (manifests), their bytes times the hours each bucket saw them stored.

`owner` None is the operator (every tenant)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from tinkerflow.common.audit import AuditEvent
from tinkerflow.common.checkpoints import Manifest, parse_time
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.usage import OpUsage, hour_start, ledger_from_memo
from tinkerflow.workflows.training_run import TrainingRunWorkflow

if TYPE_CHECKING:  # services.py imports the quota checks, which read checkpoints here
    from tinkerflow.api.services import Services

log = logging.getLogger(__name__)
GB = 1e9  # storage is billed in decimal gigabytes


@dataclass(frozen=True)
class UsageRow:
    """One hour of one training run's or one sampler's usage."""

    hour: str  # workflows/protocol/usage.py hour_of
    owner: str  # owner id ("open" when the API takes any key)
    session_id: str
    base_model: str
    source: str  # the training run's model id, or the sampling client's sampler id
    usage: OpUsage


def per_session(rows: list[UsageRow]) -> list[UsageRow]:
    """`rows` summed per (hour, owner, session, base model): the billing events' grain (their `source` is "")."""
    sums: dict[tuple[str, str, str, str], OpUsage] = {}
    for r in rows:
        key = (r.hour, r.owner, r.session_id, r.base_model)
        sums[key] = sums.get(key, OpUsage()) + r.usage
    return [UsageRow(h, o, s, m, "", u) for (h, o, s, m), u in sorted(sums.items())]


def visibility_time(t: datetime) -> str:
    """A time as a Temporal visibility query compares it (UTC, whole seconds)."""
    return t.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def day_start(t: datetime) -> datetime:
    """The start of t's UTC day: where daily usage and quotas begin."""
    return t.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def _owner_clause(owner: str | None) -> str:
    return "" if owner is None else f" AND {names.OWNER.name} = '{names.owner_value(owner)}'"


async def usage_rows(svc: Services, owner: str | None, start: datetime, end: datetime) -> list[UsageRow]:
    """Every metered hour in [start, end) of `owner`'s runs and sample batches, summed per (hour, run or sampler)."""
    rows: dict[tuple[str, str, str, str, str], OpUsage] = {}

    def add(hour: str, who: str, session_id: str, base_model: str, source: str, usage: OpUsage) -> None:
        if start <= hour_start(hour) < end and usage:
            key = (hour, who, session_id, base_model, source)
            rows[key] = rows.get(key, OpUsage()) + usage

    client = svc.client
    runs = (
        f"WorkflowType = 'TrainingRun' AND ExecutionStatus != 'ContinuedAsNew' AND StartTime < '{visibility_time(end)}'"
        + _owner_clause(owner)
    )
    async for wf in client.list_workflows(runs):
        if wf.close_time is not None and wf.close_time < start:
            continue  # closed before the window: nothing of it is in it
        attrs = wf.typed_search_attributes
        try:
            ledger = await client.get_workflow_handle(wf.id, run_id=wf.run_id).query(TrainingRunWorkflow.usage)
        except Exception as e:  # a run whose history cannot be replayed answers no usage rather than no page
            log.warning("usage: %s did not answer its usage query: %s", wf.id, e)
            continue
        model_id = wf.id.removeprefix("training-run/")
        for hour, usage in ledger.items():
            add(
                hour,
                attrs.get(names.OWNER) or "open",
                names.session_of(model_id),
                attrs.get(names.BASE_MODEL) or "",
                model_id,
                usage,
            )
    samples = f"WorkflowType = 'SampleRequest' AND CloseTime >= '{visibility_time(start)}'" + _owner_clause(owner)
    async for wf in client.list_workflows(samples):
        memo = await wf.memo()
        who = wf.typed_search_attributes.get(names.OWNER) or "open"
        sampler_id = wf.id.removeprefix("sample/").rsplit("/", 1)[0]  # names.sample_workflow_id
        for hour, usage in ledger_from_memo(memo.get("usage")).items():
            add(hour, who, str(memo.get("session_id") or ""), str(memo.get("base_model") or ""), sampler_id, usage)
    return [UsageRow(h, o, s, m, src, u) for (h, o, s, m, src), u in sorted(rows.items())]


async def checkpoints_of(svc: Services, owner: str | None) -> list[Manifest]:
    """The current (committed, unexpired) checkpoints of `owner`, or of everyone."""
    manifests = await asyncio.to_thread(svc.checkpoints.list)
    return [m for m in manifests if owner is None or names.owner_value(m.owner) == names.owner_value(owner)]


def storage_gigabyte_hours(manifests: list[Manifest], hour: datetime, now: datetime) -> list[tuple[Manifest, float]]:
    """GB-hours each checkpoint was stored during the hour starting at `hour` (up to `now`)."""
    out: list[tuple[Manifest, float]] = []
    for m in manifests:
        saved = parse_time(m.time)
        if saved is None:
            continue
        stored = min(hour + timedelta(hours=1), now) - max(hour, saved)
        if stored > timedelta(0) and m.size_bytes:
            out.append((m, m.size_bytes / GB * stored.total_seconds() / 3600))
    return out


async def derived_audit(svc: Services, owner: str | None, day: datetime) -> list[AuditEvent]:
    """The audit events whose record already lives elsewhere: checkpoints committed (their manifests), sessions and
    runs created and ended (Temporal's visibility), within the UTC day starting at `day`."""
    day_end = day + timedelta(days=1)
    events: list[AuditEvent] = []
    for m in await checkpoints_of(svc, owner):
        saved = parse_time(m.time)
        if saved is not None and day <= saved < day_end:
            details = {"size_bytes": m.size_bytes, "base_model": m.base_model}
            events.append(AuditEvent(saved, "checkpoint_created", names.owner_value(m.owner), m.tinker_path, details))
    window = (
        f"StartTime < '{visibility_time(day_end)}' "
        f"AND (CloseTime >= '{visibility_time(day)}' OR ExecutionStatus = 'Running')"
    )
    for workflow_type, resource, prefix in (
        ("Session", "session", "session/"),
        ("TrainingRun", "run", "training-run/"),
    ):
        query = f"WorkflowType = '{workflow_type}' AND {window}" + _owner_clause(owner)
        async for wf in svc.client.list_workflows(query):
            who, obj = wf.typed_search_attributes.get(names.OWNER) or "open", wf.id.removeprefix(prefix)
            status = wf.status.name.lower() if wf.status is not None else ""
            if (
                wf.start_time is not None
                and day <= wf.start_time < day_end
                and wf.run_id == (wf.raw_info.first_run_id or wf.run_id)
            ):
                events.append(AuditEvent(wf.start_time, f"{resource}_created", who, obj))
            ended = wf.close_time is not None and status != "continued_as_new"
            if ended and wf.close_time is not None and day <= wf.close_time < day_end:
                events.append(AuditEvent(wf.close_time, f"{resource}_ended", who, obj, {"status": status}))
    return events
