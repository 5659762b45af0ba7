"""Connecting to Temporal, and making sure the namespace knows our search attributes."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.common import SearchAttributeIndexedValueType
from temporalio.service import TLSConfig

from tinkerflow.common.settings import Settings
from tinkerflow.workflows.protocol import names

log = logging.getLogger(__name__)


def tls_config(settings: Settings) -> TLSConfig | bool:
    """mTLS from --temporal-tls-cert/-key (and -ca); False (plain) when none is set."""
    if not (settings.temporal_tls_cert or settings.temporal_tls_key or settings.temporal_tls_ca):
        return False
    if bool(settings.temporal_tls_cert) != bool(settings.temporal_tls_key):
        raise ValueError("--temporal-tls-cert and --temporal-tls-key go together (both PEM files)")

    def read(path: str) -> bytes | None:
        return Path(path).expanduser().read_bytes() if path else None

    return TLSConfig(
        client_cert=read(settings.temporal_tls_cert),
        client_private_key=read(settings.temporal_tls_key),
        server_root_ca_cert=read(settings.temporal_tls_ca),
    )


async def connect(settings: Settings, *, wait_s: float = 60.0) -> Client:
    """Connect, retrying while the server starts (a fresh dev server takes a moment to open its port)."""
    deadline = time.monotonic() + wait_s
    tls = tls_config(settings)
    while True:
        try:
            return await Client.connect(settings.temporal_address, namespace=settings.temporal_namespace, tls=tls)
        except Exception as e:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"cannot reach Temporal at {settings.temporal_address} ({e}); start it with `tinkerflow temporal` "
                    "or pass --temporal-address"
                ) from e
            await asyncio.sleep(0.3)


async def ensure_search_attributes(client: Client, namespace: str) -> None:
    """Register the custom search attributes workflows upsert (idempotent: only the missing ones are added)."""
    existing = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
    wanted = {
        key.name: IndexedValueType.ValueType(SearchAttributeIndexedValueType(key.indexed_value_type).value)
        for key in names.SEARCH_ATTRIBUTES
    }
    missing = {n: t for n, t in wanted.items() if n not in existing.custom_attributes}
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(search_attributes=missing, namespace=namespace)
        )
        log.info("registered search attributes %s", ", ".join(sorted(missing)))
