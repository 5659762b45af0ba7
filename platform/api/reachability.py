"""Whether the API's upstreams (Temporal, the claim-check store) are reachable, and what to answer when one is not.

While a dependency is down every route answers 503 with a body naming it and a `Retry-After` (the SDK retries 5xx
with backoff, so a short outage costs a client only time); `/api/v1/readyz` checks both so a load balancer or a
Kubernetes readiness probe stops routing to an API that cannot serve, while `/api/v1/healthz` stays liveness only
(the process answers) so a Temporal outage never makes Kubernetes restart healthy API pods.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import uuid
from dataclasses import dataclass
from datetime import timedelta

from temporalio.api.workflowservice.v1 import GetSystemInfoRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from tinkerflow.common.storage_faults import chain, storage_fault
from tinkerflow.common.store import ClaimCheckStore, write_whole

log = logging.getLogger(__name__)
RETRY_AFTER_S = 5
CHECK_TIMEOUT_S = 1.5  # both checks run at once and answer within the 2 s the Kubernetes readiness probe waits
# gRPC statuses that mean "the server is not there right now", not "the request was wrong".
_UNREACHABLE = {RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED, RPCStatusCode.CANCELLED}


@dataclass(frozen=True)
class Unavailable:
    """A dependency that cannot serve: which one, where, and why (for the 503 body and the log)."""

    dependency: str  # "temporal" | "store"
    where: str
    why: str

    def message(self) -> str:
        name = {"temporal": "Temporal", "store": "the claim-check store"}[self.dependency]
        return (
            f"{name} ({self.where}) is unreachable: {self.why}. This API cannot serve requests until it is "
            f"back; retry after {RETRY_AFTER_S} s"
        )

    def body(self) -> dict:
        return {"detail": self.message(), "unavailable": self.dependency, "retry_after_s": RETRY_AFTER_S}


def classify(e: BaseException, temporal_address: str, store_url: str) -> Unavailable | None:
    """Which dependency an exception escaping a route says is down (None: a bug or a bad request, not an outage)."""
    for link in chain(e):
        if isinstance(link, RPCError) and link.status in _UNREACHABLE:
            return Unavailable("temporal", temporal_address, link.message or link.status.name)
        # temporalio's core raises a plain RuntimeError when it cannot (re)connect at all ("Failed client connect:
        # Server connection error: tonic::transport::Error(...)").
        if isinstance(link, RuntimeError) and any(m in str(link) for m in ("client connect", "transport::Error")):
            return Unavailable("temporal", temporal_address, str(link)[:300])
    fault = storage_fault(e)
    if fault:
        return Unavailable("store", store_url, fault)
    return None


async def check_temporal(client: Client, address: str) -> Unavailable | None:
    try:
        await asyncio.wait_for(
            client.workflow_service.get_system_info(GetSystemInfoRequest(), timeout=timedelta(seconds=CHECK_TIMEOUT_S)),
            CHECK_TIMEOUT_S + 1,
        )
    except Exception as e:  # any failure to answer this cheap call means requests would fail too
        return Unavailable("temporal", address, str(e)[:300] or type(e).__name__)
    return None


async def check_store(store: ClaimCheckStore) -> Unavailable | None:
    """Write, read back and delete a few bytes: what every forward_backward does to the store."""

    def probe() -> None:
        path = f"{store.root}/readyz/{uuid.uuid4().hex}"
        store.fs.makedirs(f"{store.root}/readyz", exist_ok=True)
        write_whole(store.fs, path, b"ok")
        try:
            if store.fs.cat_file(path) != b"ok":
                raise OSError(errno.EIO, "read back other bytes than written")
        finally:
            store.fs.rm(path)

    try:
        await asyncio.wait_for(asyncio.to_thread(probe), CHECK_TIMEOUT_S)
    except Exception as e:
        return Unavailable("store", store.url, storage_fault(e) or str(e)[:300] or type(e).__name__)
    return None
