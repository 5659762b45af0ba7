"""A client that goes away mid-request is an answer nobody reads, never an ASGI error in the API's log: what the
60-minute recipe soak found (recipes ending while their SDK's futures long poll was in flight)."""

from __future__ import annotations

import asyncio

import fsspec
import pytest
from fastapi import HTTPException
from starlette.requests import Request

from tinkerflow.api import session_futures
from tinkerflow.api.lookups import CLIENT_CLOSED, json_body


def test_a_body_cut_off_by_the_client_is_a_499_not_an_exception():
    async def receive():
        return {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "path": "/api/v1/retrieve_futures", "headers": []}, receive)
    with pytest.raises(HTTPException) as e:
        asyncio.run(json_body(request))
    assert e.value.status_code == CLIENT_CLOSED


def test_a_retrieved_future_removed_by_a_concurrent_poll_is_forgotten_quietly(tmp_path):
    class Store:
        fs = fsspec.filesystem("file")

    class Svc:
        store = Store()

    record = tmp_path / "00000000000000000006"
    record.write_text("{}")
    session_futures._forget(Svc(), str(record))  # pyright: ignore[reportArgumentType]
    assert not record.exists()
    session_futures._forget(Svc(), str(record))  # pyright: ignore[reportArgumentType]  # the second poll's
