"""A second `tinkerflow up` on the same state dir finds its history again (Temporal's SQLite file persists), even
after the first was killed with SIGKILL, which its parts do not survive."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
import tinker
from temporalio.client import Client

from tinkerflow.cli.launch import launch

pytestmark = pytest.mark.e2e


def _alive_in_groups(groups: set[int]) -> list[str]:
    """Processes (not zombies) still running in these process groups: each part of `up` leads its own."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            name, rest = stat.read_text().rsplit(")", 1)
        except OSError:
            continue  # exited meanwhile
        state, _ppid, pgrp = rest.split()[:3]
        if int(pgrp) in groups and state != "Z":
            alive.append(f"{stat.parent.name} {name.split('(', 1)[1]}")
    return alive


def test_second_up_on_same_state_dir_finds_its_sessions(tmp_path):
    state = tmp_path / "state"
    first = launch(state, api_key="tml-restart")
    try:
        client = tinker.ServiceClient(base_url=first.base_url, api_key="tml-restart")
        training = client.create_lora_training_client(base_model=first.served_model(), rank=4).result()
        model_id = training.model_id
    finally:
        # SIGKILL: `up` runs no clean-up at all. Its parts asked to die with it (PR_SET_PDEATHSIG), so none may be
        # left holding the ports and the state dir.
        groups = {part["pid"] for part in first.parts().values()}
        first.proc.kill()
        first.proc.wait()
    deadline = time.monotonic() + 60  # a bound on a hang, not a timing assertion
    while _alive_in_groups(groups) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = _alive_in_groups(groups)
    for group in groups if survivors else ():  # leave nothing behind for the next test, then fail
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)
    assert survivors == []

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
