"""Who is calling, and what serves them: the FastAPI dependencies every route declares (`Depends(owner)`,
`Depends(services)`). `owner` checks the API key and names the caller's tenant; `services` is the app's one
`Services` container. (Whether the API's own upstreams, Temporal and the store, answer is reachability.py.)"""

from __future__ import annotations

import hmac

from fastapi import Request

from tinkerflow.api.http_errors import http_error
from tinkerflow.api.services import Services


def services(request: Request) -> Services:
    return request.app.state.services


def metrics_caller(request: Request) -> str:
    """/metrics callers: an API key as X-API-Key, or as `Authorization: Bearer` (what a Prometheus scrape config
    sends with `authorization: {credentials: ...}`)."""
    bearer = request.headers.get("authorization", "")
    if bearer.lower().startswith("bearer ") and not request.headers.get("x-api-key"):
        return _check(request, bearer[7:].strip())
    return owner(request)


def owner(request: Request) -> str:
    """Check X-API-Key (header names arrive lower-cased from the SDK's pyqwest transport; Starlette's lookup is
    case-insensitive) and return the caller's owner id."""
    return _check(request, request.headers.get("x-api-key"))


def usage_scope(request: Request) -> str | None:
    """The tenant whose usage the caller may read (the AdminClient's routes, the console's usage page): its own owner
    id, or None (every tenant) for the operator's key (--admin-api-key)."""
    who = owner(request)
    svc: Services = request.app.state.services
    admin = svc.settings.admin_api_key
    key = request.headers.get("x-api-key") or ""
    if admin and hmac.compare_digest(key.encode("utf-8", "replace"), admin.encode("utf-8", "replace")):
        return None
    return who


def _check(request: Request, key: str | None) -> str:
    svc: Services = request.app.state.services
    allowed = svc.api_keys
    if allowed:
        if not key:
            raise http_error(401, "missing X-API-Key header; set TINKER_API_KEY to one of the server's keys")
        # Bytes, not str: compare_digest refuses non-ASCII str (a latin-1 header would be a 500), and every key is
        # compared, so the time taken says nothing about which key (or how much of one) matched.
        given = key.encode("utf-8", "replace")
        matched = False
        for k in allowed:
            matched |= hmac.compare_digest(given, k.encode("utf-8", "replace"))
        if not matched:
            raise http_error(401, "invalid API key; set TINKER_API_KEY to one of the keys the server was started with")
    return svc.owner_of(key)
