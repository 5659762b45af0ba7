"""/client/config, read back through the SDK's own model of it: what the service turns on, and which HTTP transport it
tells every SDK client to use (--client-transport; settings_api.py says why httpx is the default)."""

from __future__ import annotations

import asyncio

from fastapi.testclient import TestClient
from temporalio.client import Client
from tinker.types import ClientConfigResponse

from tinkerflow.api.app import create_app
from tinkerflow.cli.launch import free_port
from tinkerflow.common.settings import Settings

KEY = "tml-client-config"


def _config(tmp_path, **settings) -> ClientConfigResponse:
    address = f"127.0.0.1:{free_port()}"  # nothing listens: /client/config never reaches Temporal
    s = Settings(state_dir=tmp_path, temporal_address=address, api_keys=(KEY,), **settings)
    client = asyncio.run(Client.connect(address, lazy=True))
    with TestClient(create_app(s, client=client)) as http:
        answer = http.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}, headers={"X-API-Key": KEY})
    assert answer.status_code == 200, answer.text
    return ClientConfigResponse.model_validate(answer.json())


def test_by_default_every_sdk_client_is_told_to_use_httpx(tmp_path):
    config = _config(tmp_path)
    assert config.use_pyqwest_transport is False
    # What the service needs the SDK to do stays on whatever the transport.
    assert config.sample_use_retrieve_futures and config.sample_join_sampling_session
    assert config.proto_compress_fwdbwd and config.custom_loss_server_side and not config.pjwt_auth_enabled


def test_pyqwest_is_a_choice(tmp_path):
    assert _config(tmp_path, client_transport="pyqwest").use_pyqwest_transport is True
