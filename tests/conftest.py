"""Shared test set-up: offline Hugging Face, and where the acceptance scripts live."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

REPO = Path(__file__).resolve().parents[1]
ACCEPTANCE = REPO.parent / "shared" / "acceptance"


def pytest_unconfigure(config) -> None:
    # SDK clients made by tests keep heartbeating from background threads until the interpreter exits; once their
    # stacks are stopped that only produces connection warnings after pytest's summary. Silence them then.
    import logging

    logging.getLogger("tinker.lib.internal_client_holder").setLevel(logging.CRITICAL)


@pytest.fixture(scope="session")
def gcs():
    """A GCS endpoint on loopback (gcp-storage-emulator); gcsfs finds it through STORAGE_EMULATOR_HOST. Yields the
    gs:// root of an empty bucket."""
    server_mod = pytest.importorskip("gcp_storage_emulator.server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = server_mod.create_server("127.0.0.1", port, in_memory=True, default_bucket="tinkerflow-test")
    server.start()
    mp = pytest.MonkeyPatch()
    mp.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    mp.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    yield "gs://tinkerflow-test"
    mp.undo()
    server.stop()
