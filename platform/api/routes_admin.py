"""What tinker's `AdminClient` reads: hourly billing usage, current checkpoint storage and the audit log of a day.

Bodies are the SDK's own response models (tinker.types), so the unmodified SDK parses them. Every key sees only its
own tenant's; the operator's key (`--admin-api-key`) sees every tenant's. Usage comes from the ledgers the workflows
keep (usage_data.py), the audit log from common/audit.py plus the facts usage_data.derived_audit reads.
No prices: tinkerflow bills nobody; `tinkerflow usage --prices FILE` estimates what the usage would cost elsewhere.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, date, datetime, timedelta

from fastapi import APIRouter, Depends
from tinker import types

from tinkerflow.api.caller import services, usage_scope
from tinkerflow.api.http_errors import http_error
from tinkerflow.api.services import Services
from tinkerflow.api.usage_data import checkpoints_of, derived_audit, per_session, storage_gigabyte_hours, usage_rows
from tinkerflow.common.checkpoints import Manifest
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.usage import hour_end, hour_of, hour_start

router = APIRouter(prefix="/api/v1")
MAX_WINDOW = timedelta(days=14)  # what the SDK documents for get_billing_usage
AUDIT_TYPES = {"all", "checkpoints", "projects", "teams", "organizations", "sessions", "runs"}


def _hour(value: str, field: str) -> datetime:
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise http_error(400, f"{field} {value!r} is not an RFC 3339 time (e.g. 2026-07-13T00:00:00Z)") from None
    if t.tzinfo is None:
        raise http_error(400, f"{field} {value!r} has no time zone; give it in UTC (…Z)")
    t = t.astimezone(UTC)
    if t != t.replace(minute=0, second=0, microsecond=0):
        raise http_error(400, f"{field} {value!r} is not aligned to a UTC hour boundary")
    return t


@router.get("/billing/usage/events")
async def billing_usage(
    starting_on: str, ending_before: str, svc: Services = Depends(services), tenant: str | None = Depends(usage_scope)
) -> dict:
    start, end = _hour(starting_on, "starting_on"), _hour(ending_before, "ending_before")
    now = datetime.now(UTC)
    if start > now:
        raise http_error(400, f"starting_on {starting_on} is in the future")
    if not start < end <= start + MAX_WINDOW:
        raise http_error(400, "ending_before must be after starting_on and at most 14 days after it")
    events: list[types.BillingUsageEvent] = []
    for row in per_session(await usage_rows(svc, tenant, start, end)):
        u = row.usage
        infos: list[types.BillingEventInfo] = [
            types.TrainingBillingEvent(token_count=u.training_tokens),
            types.SamplingPrefillBillingEvent(cached=False, token_count=u.prefill_uncached_tokens),
            types.SamplingPrefillBillingEvent(cached=True, token_count=u.prefill_cached_tokens),
            types.SamplingSampleBillingEvent(token_count=u.sampled_tokens),
            types.CheckpointBillingEvent(count=u.checkpoints),
        ]
        for info in infos:
            if (info.count if isinstance(info, types.CheckpointBillingEvent) else getattr(info, "token_count", 0)) > 0:
                events.append(_event(row.hour, row.base_model, row.owner, row.session_id, info))
    manifests = await checkpoints_of(svc, tenant)
    hour = start
    while hour < min(end, now):
        for m, gb_hours in storage_gigabyte_hours(manifests, hour, now):
            info = types.StorageBillingEvent(gigabyte_hours=gb_hours)
            events.append(_event(hour_of(hour), m.base_model, _owner(m), names.session_of(m.path.run), info))
        hour += timedelta(hours=1)
    events.sort(key=lambda e: (e.bucket_start, -getattr(e.event_info, "token_count", 0)))
    sessions = {e.session_id: types.BillingUsageSession() for e in events if e.session_id}
    return types.BillingUsageResponse(data=events, sessions=sessions).model_dump(mode="json")


def _event(
    hour: str, base_model: str, who: str, session_id: str, info: types.BillingEventInfo
) -> types.BillingUsageEvent:
    return types.BillingUsageEvent(
        bucket_start=hour_start(hour),
        bucket_end=hour_end(hour),
        base_model=base_model or None,
        user_id=who,
        session_id=session_id or None,
        event_info=info,
    )


def _owner(m: Manifest) -> str:
    return names.owner_value(m.owner)


@router.get("/billing/usage/checkpoints/current")
async def current_checkpoint_storage(
    project_id: str | None = None, svc: Services = Depends(services), tenant: str | None = Depends(usage_scope)
) -> dict:
    if project_id is not None and not 0 < len(project_id) <= 256:
        raise http_error(400, "project_id must be 1 to 256 characters")
    groups: dict[str, list[Manifest]] = {}
    for m in await checkpoints_of(svc, tenant):
        groups.setdefault(_owner(m), []).append(m)
    data = [
        types.CurrentCheckpointStorageUsageItem(
            org_user_urn=who,
            checkpoint_count=len(ms),
            size_bytes=(size := sum(m.size_bytes for m in ms)),
            size_gigabytes=size / 1e9,
        )
        for who, ms in sorted(groups.items())
    ]
    return types.CurrentCheckpointStorageUsageResponse(data=data).model_dump(mode="json")


@router.get("/audit")
async def audit_log(
    event_type: str = "all",
    day: str | None = None,
    svc: Services = Depends(services),
    tenant: str | None = Depends(usage_scope),
) -> dict:
    if event_type not in AUDIT_TYPES:
        raise http_error(400, f"event_type {event_type!r} is not one of {', '.join(sorted(AUDIT_TYPES))}")
    try:
        when = date.fromisoformat(day) if day else datetime.now(UTC).date()
    except ValueError:
        raise http_error(400, f"day {day!r} is not a date (YYYY-MM-DD)") from None
    day_start = datetime(when.year, when.month, when.day, tzinfo=UTC)
    recorded = await asyncio.to_thread(svc.audit_log.day, when)
    mine = [e for e in recorded if tenant is None or e.key_id == names.owner_value(tenant)]
    events = mine + await derived_audit(svc, tenant, day_start)
    wanted = {"checkpoints": "checkpoint", "sessions": "session", "runs": "run"}.get(event_type)
    entries = [
        types.AuditLogEntry.model_validate(e.entry())
        for e in sorted(events, key=lambda e: e.time)
        if event_type == "all" or e.resource == wanted
    ]
    return types.AuditLogResponse(entries=entries).model_dump(mode="json")
