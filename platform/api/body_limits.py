"""A body limit per route, enforced before the body is read (pure ASGI, so nothing buffers it first).

One number for every route let a 100 MB JSON reach create_session and sit in the API's memory before the route
refused it. Each route now has a limit that fits what it carries: forward_backward carries token batches
(--max-request-bytes), asample a prompt (--max-sample-body-bytes), every other route a few control fields
(--max-control-body-bytes). A declared Content-Length over the limit is answered 413 without reading a byte; a
chunked body is counted as it streams and cut off with 413 the moment it passes the limit. 413 is not retried by
the SDK, so the caller sees the message.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from tinkerflow.common.settings import Settings

Scope = dict[str, Any]
Message = dict[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

_BULK = ("/api/v1/forward_backward", "/api/v1/forward")
_SAMPLE = (
    "/api/v1/asample",
    "/api/v1/sample",
    "/api/v1/telemetry",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
)


def limit_for(settings: Settings, path: str) -> tuple[int, str]:
    """(bytes, the flag that sets it) for a request path."""
    if path in _BULK:
        return settings.max_request_bytes, "--max-request-bytes"
    if path in _SAMPLE:
        return min(settings.max_sample_body_bytes, settings.max_request_bytes), "--max-sample-body-bytes"
    return min(settings.max_control_body_bytes, settings.max_request_bytes), "--max-control-body-bytes"


class _TooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app: ASGIApp, settings: Settings):
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, flag = limit_for(self.settings, scope.get("path", ""))
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > limit:
            await _refuse(send, int(length), limit, flag)
            return
        seen = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _TooLarge()
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except BaseException as e:
            # Middleware built on task groups (BaseHTTPMiddleware) hands it on wrapped in an exception group.
            if not _too_large(e):
                raise
            if not started:
                await _refuse(send, seen, limit, flag, streamed=True)


def _too_large(e: BaseException) -> bool:
    if isinstance(e, _TooLarge):
        return True
    return isinstance(e, BaseExceptionGroup) and any(_too_large(x) for x in e.exceptions)


async def _refuse(send, size: int, limit: int, flag: str, streamed: bool = False) -> None:
    what = f"more than {limit:,} bytes" if streamed else f"{size:,} bytes"
    detail = f"request body of {what} is over this route's limit of {limit:,} bytes ({flag}); send less per request"
    await send_detail(send, 413, detail, close=True)  # close: the rest of the body is never read


async def send_detail(send, status: int, detail: str, close: bool = False) -> None:
    """An error answered from middleware, in the app's error shape ({"detail": ...}): the SDK retries an empty 400."""
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
