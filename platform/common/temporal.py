"""Connecting to Temporal, and making sure the namespace knows our search attributes."""

from __future__ import annotations

import asyncio
import logging
import time

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.common import SearchAttributeIndexedValueType

from tinkerflow.common.settings import Settings
from tinkerflow.workflows import names

log = logging.getLogger(__name__)


async def connect(settings: Settings, *, wait_s: float = 60.0) -> Client:
    """Connect, retrying while the server starts (a fresh dev server takes a moment to open its port)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await Client.connect(settings.temporal_address, namespace=settings.temporal_namespace)
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
