"""Shared test set-up: offline Hugging Face, and where the acceptance scripts live."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")
# Every stack a test starts compiles the same tiny-model programs: they share one XLA persistent compilation cache for
# the session (the path a restarted production worker takes), so only the first stack pays for the compiles.
_COMPILE_CACHE = tempfile.TemporaryDirectory(prefix="tinkerflow-xla-cache-")
os.environ.setdefault("TINKERFLOW_COMPILATION_CACHE_DIR", _COMPILE_CACHE.name)

REPO = Path(__file__).resolve().parents[1]
ACCEPTANCE = REPO.parent / "shared" / "acceptance"


def slow_selected(config) -> bool:
    """Slow tests (long matrices, recompiling fault cases) run only when asked for: TINKERFLOW_SLOW_TESTS=1, or a
    marker expression naming `slow` (`bash scripts/test.sh -m slow` runs just them). CI runs the default set."""
    return os.environ.get("TINKERFLOW_SLOW_TESTS") == "1" or "slow" in (config.getoption("markexpr") or "")


def pytest_collection_modifyitems(config, items) -> None:
    if slow_selected(config):
        return
    fuzz = REPO / "tests" / "fuzz"  # the fuzz suite has its own switch (TINKERFLOW_FUZZ=long), see its conftest
    skip = pytest.mark.skip(reason="slow test: set TINKERFLOW_SLOW_TESTS=1 or select -m slow to run it")
    for item in items:
        if "slow" in item.keywords and not Path(str(item.fspath)).is_relative_to(fuzz):
            item.add_marker(skip)


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
