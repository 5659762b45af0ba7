"""A second `tinkerflow up` on the same state dir finds its history again (Temporal's SQLite file persists)."""

from __future__ import annotations

import asyncio

import pytest
import tinker
from temporalio.client import Client

from tinkerflow.cli.launch import launch

pytestmark = pytest.mark.e2e


def test_second_up_on_same_state_dir_finds_its_sessions(tmp_path):
    state = tmp_path / "state"
    first = launch(state, api_key="tml-restart")
    try:
        client = tinker.ServiceClient(base_url=first.base_url, api_key="tml-restart")
        training = client.create_lora_training_client(base_model=first.served_model(), rank=4).result()
        model_id = training.model_id
    finally:
        first.stop()

    second = launch(state, api_key="tml-restart")
    try:
        async def describe() -> tuple[str, str]:
            temporal = await Client.connect(second.temporal_address)
            session = await temporal.get_workflow_handle(f"session/{model_id.split(':')[0]}").describe()
            run = await temporal.get_workflow_handle(f"training-run/{model_id}").describe()
            return session.workflow_type, run.workflow_type

        assert asyncio.run(describe()) == ("Session", "TrainingRun")
    finally:
        second.stop()
