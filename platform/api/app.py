"""The FastAPI application: routes, error shapes, and the services every route shares."""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from temporalio.client import Client

from tinkerflow.api import (
    routes_checkpoints, routes_futures, routes_runs, routes_sampling, routes_service, routes_training,
)
from tinkerflow.api.deps import metrics_caller
from tinkerflow.api.signed_urls import signing_key
from tinkerflow.api.sample_batches import SampleBatcher
from tinkerflow.api.services import ModelRegistry, Services
from tinkerflow.common.metrics import API_LATENCY, API_REQUESTS
from tinkerflow.common.checkpoints import CheckpointStore
from tinkerflow.common.settings import Settings
from tinkerflow.common.store import ClaimCheckStore
from tinkerflow.common.temporal import connect, ensure_search_attributes

log = logging.getLogger(__name__)


def create_app(settings: Settings, client: Client | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        temporal = client or await connect(settings)
        try:
            await ensure_search_attributes(temporal, settings.temporal_namespace)
        except Exception as e:  # another process may be registering them at the same moment
            log.debug("search attributes: %s", e)
        app.state.services = Services(settings=settings, client=temporal,
                                      store=ClaimCheckStore(settings.resolved_store_url),
                                      registry=ModelRegistry(temporal),
                                      checkpoints=CheckpointStore(settings.resolved_checkpoint_root),
                                      signing_key=signing_key(settings), api_keys=settings.accepted_api_keys(),
                                      sample_batcher=SampleBatcher(temporal))
        if not app.state.services.api_keys:
            log.warning("no API keys configured (--api-key / TINKERFLOW_API_KEYS): the API accepts any key")
        yield

    docs = settings.api_docs  # off: /openapi.json, /docs and /redoc answer 404 like any unknown path
    app = FastAPI(title="tinkerflow", description="Tinker-compatible training API on Temporal and JAX",
                  lifespan=lifespan, openapi_url="/openapi.json" if docs else None,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None)
    for module in (routes_service, routes_training, routes_sampling, routes_futures, routes_runs, routes_checkpoints):
        app.include_router(module.router)

    if settings.metrics_access != "off":
        @app.get("/metrics", include_in_schema=False)
        async def metrics(request: Request) -> Response:
            if settings.metrics_access != "public":
                metrics_caller(request)
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.middleware("http")
    async def observe(request: Request, call_next):
        started = time.perf_counter()
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > settings.max_request_bytes:
            # Refused before the body is read; 413 is not retried by the SDK, so the caller sees this message.
            response: Response = JSONResponse(status_code=413, content={
                "detail": f"request body of {int(length):,} bytes is over this server's limit of "
                          f"{settings.max_request_bytes:,} (--max-request-bytes); send fewer datums per request"})
        else:
            response = await call_next(request)
        route = request.scope.get("route")
        name = getattr(route, "path", "unmatched")  # the template, e.g. /api/v1/samplers/{sampler_id}
        API_REQUESTS.labels(name, str(response.status_code)).inc()
        API_LATENCY.labels(name).observe(time.perf_counter() - started)
        return response

    # Every error carries a JSON body: the SDK treats an empty 400 as a proxy glitch and retries it.
    @app.exception_handler(ValidationError)
    async def _pydantic_error(_: Request, e: ValidationError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": f"invalid request: {e}"})

    @app.exception_handler(RequestValidationError)
    async def _request_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": f"invalid request: {e}"})

    return app
