"""FastAPI dependencies: the services container and the caller's identity (API key)."""

from __future__ import annotations

import hmac

from fastapi import Request

from tinkerflow.api.errors import http_error
from tinkerflow.api.services import Services


def services(request: Request) -> Services:
    return request.app.state.services


def owner(request: Request) -> str:
    """Check X-API-Key (header names arrive lower-cased from the SDK's pyqwest transport; Starlette's lookup is
    case-insensitive) and return the caller's owner id."""
    svc: Services = request.app.state.services
    key = request.headers.get("x-api-key")
    allowed = svc.api_keys
    if allowed:
        if not key:
            raise http_error(401, "missing X-API-Key header; set TINKER_API_KEY to one of the server's keys")
        if not any(hmac.compare_digest(key, k) for k in allowed):
            raise http_error(401, "invalid API key; set TINKER_API_KEY to one of the keys the server was started with")
    return svc.owner_of(key)
