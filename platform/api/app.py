"""The FastAPI application: routes, error shapes, and the services every route shares."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from temporalio.client import Client

from tinkerflow.api import (
    console_data,
    console_usage,
    routes_admin,
    routes_anthropic,
    routes_checkpoints,
    routes_console,
    routes_custom_loss,
    routes_futures,
    routes_openai,
    routes_run_metrics,
    routes_runs,
    routes_sampling,
    routes_service,
    routes_session_futures,
    routes_training,
)
from tinkerflow.api.body_limits import BodyLimit
from tinkerflow.api.caller import metrics_caller
from tinkerflow.api.json_depth import JsonDepthLimit
from tinkerflow.api.json_wire import WireJSONResponse
from tinkerflow.api.ledger_watch import watch
from tinkerflow.api.observe import Observe
from tinkerflow.api.quota_checks import Quotas
from tinkerflow.api.reachability import RETRY_AFTER_S, check_store, check_temporal
from tinkerflow.api.sample_batches import SampleBatcher
from tinkerflow.api.services import ModelRegistry, Services
from tinkerflow.api.signed_urls import signing_key
from tinkerflow.api.worker_metrics import WorkerMetrics, worker_metrics_urls
from tinkerflow.common.checkpoints import CheckpointStore
from tinkerflow.common.errors import TinkerflowError
from tinkerflow.common.settings import Settings
from tinkerflow.common.store import ClaimCheckStore
from tinkerflow.common.temporal import connect, ensure_search_attributes
from tinkerflow.common.tenancy import tenant_mode

log = logging.getLogger(__name__)
SEED_WAIT_S = 60


def reload_on_sighup(quotas: Quotas) -> Callable[[], None]:
    """SIGHUP re-reads the quota file; returns what undoes it. Only the main thread may take signals (a test's app
    runs elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, quotas.reload)

    def stop() -> None:
        loop.remove_signal_handler(signal.SIGHUP)

    return stop


def create_app(settings: Settings, client: Client | None = None) -> FastAPI:
    """The app; QuotaFileError or SettingsError when its configuration is refused (before anything serves)."""
    settings.check_api()
    quotas = Quotas.from_settings(settings, lambda: signing_key(settings))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        temporal = client or await connect(settings)
        try:
            await ensure_search_attributes(temporal, settings.temporal_namespace)
        except Exception as e:  # another process may be registering them at the same moment
            log.debug("search attributes: %s", e)
        app.state.services = Services(
            settings=settings,
            client=temporal,
            store=ClaimCheckStore(settings.resolved_store_url),
            registry=ModelRegistry(temporal),
            checkpoints=CheckpointStore(settings.resolved_checkpoint_root),
            signing_key=signing_key(settings),
            api_keys=settings.accepted_api_keys(),
            sample_batcher=SampleBatcher(temporal),
            worker_metrics=WorkerMetrics(urls) if (urls := worker_metrics_urls(settings)) else None,
            quotas=quotas,
        )
        if not app.state.services.api_keys:
            log.warning("%s (--api-key / TINKERFLOW_API_KEYS)", tenant_mode(False))
        seeded = asyncio.Event()
        watcher = asyncio.create_task(watch(temporal, quotas.tally, settings.ledger_read_s, seeded))
        if quotas.configured:  # the day's usage before the first op is checked (quota_tally.py)
            try:
                await asyncio.wait_for(seeded.wait(), timeout=SEED_WAIT_S)
            except TimeoutError:
                log.error(
                    "quotas: the metering ledgers could not be read within %d s; until they are, the tallies count "
                    "only what this process accepts",
                    SEED_WAIT_S,
                )
        stop_reloading = reload_on_sighup(quotas)
        try:
            yield
        finally:
            stop_reloading()
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    docs = settings.api_docs  # off: /openapi.json, /docs and /redoc answer 404 like any unknown path
    app = FastAPI(
        title="tinkerflow",
        description="Tinker-compatible training API on Temporal and JAX",
        lifespan=lifespan,
        default_response_class=WireJSONResponse,
        openapi_url="/openapi.json" if docs else None,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
    )
    for module in (routes_service, routes_training, routes_sampling, routes_futures, routes_runs, routes_checkpoints):
        app.include_router(module.router)
    app.include_router(routes_session_futures.router)  # retrieve_futures, join_sampling_session, cancel_future
    app.include_router(routes_custom_loss.router)  # create_custom_loss (docs/custom-losses.md)
    app.include_router(routes_run_metrics.router)  # per-run metric points (docs/metrics.md)
    app.include_router(routes_openai.router)  # OpenAI-compatible /v1/completions, /v1/chat/completions, /v1/models
    app.include_router(routes_anthropic.router)  # Anthropic-compatible /v1/messages, /v1/messages/count_tokens
    app.include_router(routes_admin.router)  # tinker's AdminClient: billing usage, checkpoint storage, audit log
    app.include_router(console_data.router)  # the console's JSON, under /api/v1/console (keyed like the rest)
    app.include_router(console_usage.router)  # the console's usage page data, from the AdminClient routes' ledgers
    app.include_router(routes_console.router)  # the web console's pages and assets at /console (docs/console.md)

    @app.get("/api/v1/readyz", include_in_schema=False)
    async def readyz(request: Request) -> JSONResponse:
        """Readiness (not liveness, that is /api/v1/healthz): 200 only while Temporal and the store both answer."""
        svc = request.app.state.services
        checks = await asyncio.gather(check_temporal(svc.client, settings.temporal_address), check_store(svc.store))
        down = [u for u in checks if u is not None]
        if down:
            return JSONResponse(
                status_code=503,
                headers={"Retry-After": str(RETRY_AFTER_S)},
                content={
                    "status": "unavailable",
                    "detail": "; ".join(u.message() for u in down),
                    "unavailable": [u.dependency for u in down],
                },
            )
        return JSONResponse({"status": "ready", "temporal": "ok", "store": "ok"})

    if settings.metrics_access != "off":

        @app.get("/metrics", include_in_schema=False)
        async def metrics(request: Request) -> Response:
            if settings.metrics_access != "public":
                metrics_caller(request)
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(Observe, settings=settings)  # counts and times every answer; 503 for a dependency down

    # Inside BodyLimit, which bounds what it reads; outside the rest: a body nested too deep never reaches a parser.
    app.add_middleware(JsonDepthLimit)
    # Added last, so outermost: a body over its route's limit is refused before anything reads it.
    app.add_middleware(BodyLimit, settings=settings)

    # Every error carries a JSON body: the SDK treats an empty 400 as a proxy glitch and retries it.
    @app.exception_handler(ValidationError)
    async def _pydantic_error(_: Request, e: ValidationError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": f"invalid request: {e}"})

    # A taxonomy error no route caught answers the status its type states (tinkerflow.common.errors), not a 500.
    @app.exception_handler(TinkerflowError)
    async def _taxonomy_error(_: Request, e: TinkerflowError) -> JSONResponse:
        return JSONResponse(status_code=e.http_status, content={"detail": str(e)})

    @app.exception_handler(RequestValidationError)
    async def _request_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"detail": f"invalid request: {e}"})

    return app
