"""The namespace retention `up` sets on its own Temporal: as long as the claim-check store keeps payloads."""

from __future__ import annotations

import asyncio
import subprocess
import time
from datetime import timedelta

from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.client import Client

from tinkerflow.cli import temporal_server
from tinkerflow.cli.launch import free_port
from tinkerflow.cli.up import listens


def test_retention_follows_the_store_and_never_goes_below_a_day():
    assert temporal_server.retention_for(7 * 86400) == timedelta(days=7)
    assert temporal_server.retention_for(3600) == timedelta(days=1)
    assert temporal_server.retention_for(0) == timedelta(days=1)  # store never collects: Temporal's floor


def test_set_retention_on_a_dev_server(tmp_path):
    port = free_port()
    server = subprocess.Popen(
        temporal_server.command(tmp_path / "t.db", port=port, headless=True),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not listens(server.pid, port):  # `up`'s readiness: the server itself holds its port
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(0.1)

        async def go() -> timedelta:
            address = f"127.0.0.1:{port}"
            await temporal_server.set_retention(address, "default", timedelta(days=3))
            client = await Client.connect(address)
            described = await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace="default"))
            return described.config.workflow_execution_retention_ttl.ToTimedelta()

        assert asyncio.run(go()) == timedelta(days=3)
    finally:
        server.terminate()
        server.wait()
