"""Observe (the API's outermost-but-one middleware): every answer is counted under its route's template and status
and timed; an unknown path counts as `unmatched`. The 503 mapping of a dependency outage is tests/api/
test_reachability.py."""

from __future__ import annotations

import asyncio

from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from temporalio.client import Client

from tinkerflow.api.app import create_app
from tinkerflow.cli.launch import free_port
from tinkerflow.common.settings import Settings

KEY = "tml-observe"


def _count(route: str, status: str) -> float:
    return REGISTRY.get_sample_value("tinkerflow_api_requests_total", {"route": route, "status": status}) or 0.0


def _timed(route: str) -> float:
    return REGISTRY.get_sample_value("tinkerflow_api_request_seconds_count", {"route": route}) or 0.0


def test_answers_are_counted_by_route_template_and_status(tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens: these routes never reach Temporal
    settings = Settings(state_dir=tmp_path, temporal_address=address, api_keys=(KEY,))
    client = asyncio.run(Client.connect(address, lazy=True))
    before = {
        "config": _count("/api/v1/client/config", "200"),
        "config_timed": _timed("/api/v1/client/config"),
        "unauthorised": _count("/api/v1/client/config", "401"),
        "unmatched": _count("unmatched", "404"),
    }
    with TestClient(create_app(settings, client=client), raise_server_exceptions=False) as http:
        for _ in range(3):
            assert http.post("/api/v1/client/config", json={}, headers={"X-API-Key": KEY}).status_code == 200
        assert http.post("/api/v1/client/config", json={}, headers={"X-API-Key": "tml-wrong"}).status_code == 401
        assert http.get("/api/v1/no_such_route").status_code == 404
    assert _count("/api/v1/client/config", "200") - before["config"] == 3
    assert _timed("/api/v1/client/config") - before["config_timed"] == 4
    assert _count("/api/v1/client/config", "401") - before["unauthorised"] == 1
    assert _count("unmatched", "404") - before["unmatched"] == 1
