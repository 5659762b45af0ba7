"""Every HTTP answer counted and timed (Prometheus), and a dependency outage answered 503 naming it.

Pure ASGI rather than `@app.middleware("http")`: Starlette's BaseHTTPMiddleware runs each request through a task
group and memory streams, a per-request cost that every asample and retrieve_future call paid (about half of the
API's own CPU in a py-spy profile of 128 concurrent sample calls). This does the same work around the same app.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi.responses import JSONResponse

from tinkerflow.api.body_limits import ASGIApp, Message, Scope
from tinkerflow.api.reachability import RETRY_AFTER_S, classify
from tinkerflow.common.metrics import API_LATENCY, API_REQUESTS
from tinkerflow.common.settings import Settings

log = logging.getLogger(__name__)


class Observe:
    def __init__(self, app: ASGIApp, settings: Settings):
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status: int | None = None

        async def observed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = list(message.get("headers") or [])
                if status == 503 and not any(k.lower() == b"retry-after" for k, _ in headers):
                    # The SDK retries 5xx with its own backoff; a person or a proxy reads this.
                    message = {**message, "headers": [*headers, (b"retry-after", str(RETRY_AFTER_S).encode())]}
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        except Exception as e:
            down = classify(e, self.settings.temporal_address, self.settings.resolved_store_url)
            if down is None or status is not None:  # a bug (500 from the server error handler), or too late
                raise
            log.warning("%s %s: %s", scope.get("method", ""), scope.get("path", ""), down.message())
            answer = JSONResponse(status_code=503, content=down.body())
            await answer(scope, receive, observed_send)  # pyright: ignore[reportArgumentType] (Starlette's Send type)
        # The router records the matched route in the scope: its template, e.g. /api/v1/samplers/{sampler_id}.
        name = getattr(scope.get("route"), "path", "unmatched")
        API_REQUESTS.labels(name, str(status)).inc()
        API_LATENCY.labels(name).observe(time.perf_counter() - started)
