"""The console's usage page data (docs/console.md §Usage): metered tokens by kind, by UTC day and per training run or
sampler, read from the ledgers tinker's AdminClient routes read (usage_data.usage_rows, one road). A key sees its
own tenant's; the operator's key (--admin-api-key) sees every tenant's, with the owner id on each row, and may
narrow the page to one tenant."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from fastapi import APIRouter, Depends, Query

from tinkerflow.api.caller import services, usage_scope
from tinkerflow.api.http_errors import http_error
from tinkerflow.api.routes_admin import MAX_WINDOW
from tinkerflow.api.services import Services
from tinkerflow.api.usage_data import UsageRow, day_start, usage_rows
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.usage import OpUsage

router = APIRouter(prefix="/api/v1/console")
# The columns, in the page's order: the ledger's fields, prefill split as billing splits it.
KINDS = (
    "training_tokens",
    "prefill_uncached_tokens",
    "prefill_cached_tokens",
    "sampled_tokens",
    "checkpoints",
    "checkpoint_bytes",
)
# An owner id as rows show it (common/tenancy.key_id, or "open" when the API takes any key); it becomes part of a
# visibility query, so nothing else is let through.
OWNER_ID = re.compile(r"[0-9a-f]{16}|open")


def _kinds(usage: OpUsage) -> dict[str, int]:
    return {kind: getattr(usage, kind) for kind in KINDS}


def _sums(rows: list[UsageRow], key: Callable[[UsageRow], tuple[str, ...]]) -> dict[tuple[str, ...], OpUsage]:
    out: dict[tuple[str, ...], OpUsage] = {}
    for r in rows:
        k = key(r)
        out[k] = out.get(k, OpUsage()) + r.usage
    return out


@router.get("/usage")
async def usage(
    days: int = Query(7, ge=1, le=MAX_WINDOW.days, description="UTC days shown, today included"),
    tenant: str = Query("", max_length=16, description="the operator's key only: one tenant's owner id"),
    svc: Services = Depends(services),
    scope: str | None = Depends(usage_scope),
) -> dict:
    if tenant and not OWNER_ID.fullmatch(tenant):
        raise http_error(400, f"tenant {tenant!r} is not an owner id (16 hex digits, or 'open')")
    if tenant and scope is not None and tenant != names.owner_value(scope):
        raise http_error(403, "tenant: only the operator's key (--admin-api-key) reads another tenant's usage")
    today = day_start(datetime.now(UTC))
    start, end = today - timedelta(days=days - 1), today + timedelta(days=1)
    rows = await usage_rows(svc, scope if scope is not None else (tenant or None), start, end)
    by_day = _sums(rows, lambda r: (r.hour[:10], r.owner))
    by_source = _sums(rows, lambda r: (r.source, r.owner, r.session_id, r.base_model))
    return {
        "operator": scope is None,
        "start": start.isoformat(),
        "end": end.isoformat(),
        "kinds": list(KINDS),
        "days": [{"day": d, "owner": o, **_kinds(u)} for (d, o), u in sorted(by_day.items(), reverse=True)],
        "runs": [
            {
                "id": src,
                "kind": "training run" if ":train:" in src else "sampler",
                "owner": o,
                "session_id": s,
                "base_model": m,
                **_kinds(u),
            }
            for (src, o, s, m), u in sorted(by_source.items())
        ],
        "tenants": sorted({r.owner for r in rows}) if scope is None else [],
    }
