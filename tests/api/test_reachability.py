# pyright: reportOptionalMemberAccess=false
# (this test reads Optional results where a None fails the test at once, as an assert would)
"""Dependencies down, said plainly: with Temporal or the store unreachable every route answers 503 naming it, with a
Retry-After; /api/v1/readyz says which is down while /api/v1/healthz (liveness) stays 200; storage faults on the JAX
worker fail the op as what they are."""

from __future__ import annotations

import asyncio
import errno
from typing import cast

import pytest
from fastapi.testclient import TestClient
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import ActivityEnvironment

from tinkerflow.api.app import create_app
from tinkerflow.api.reachability import classify
from tinkerflow.cli.launch import free_port
from tinkerflow.common.settings import Settings
from tinkerflow.common.storage_faults import storage_fault
from tinkerflow.workers.engine.interface import EngineApi

KEY = "tml-deps"
H = {"X-API-Key": KEY}


def test_classify_names_the_dependency_and_leaves_bugs_alone():
    down = classify(RPCError("connection refused", RPCStatusCode.UNAVAILABLE, b""), "10.0.0.1:7233", "file:///s")
    assert down is not None and down.dependency == "temporal" and "10.0.0.1:7233" in down.message()
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device", "/s/results/abc")
        except OSError as inner:
            raise RuntimeError("write failed") from inner
    except RuntimeError as e:
        down = classify(e, "t:1", "file:///s")
    assert down.dependency == "store" and "disk is full" in down.message()
    assert classify(ValueError("a bug"), "t:1", "file:///s") is None
    assert classify(RPCError("no such workflow", RPCStatusCode.NOT_FOUND, b""), "t:1", "file:///s") is None
    assert storage_fault(FileNotFoundError(errno.ENOENT, "gone")) is None  # a missing object is not an outage


@pytest.fixture
def api_without_temporal(tmp_path):
    """The API up while nothing listens where Temporal should be (it went down after the API started)."""
    address = f"127.0.0.1:{free_port()}"
    settings = Settings(state_dir=tmp_path, temporal_address=address, api_keys=(KEY,))
    client = asyncio.run(Client.connect(address, lazy=True))
    with TestClient(create_app(settings, client=client), raise_server_exceptions=False) as http:
        yield http, address


def test_every_route_answers_503_naming_temporal_with_retry_after(api_without_temporal):
    http, _address = api_without_temporal
    for method, path, body in [
        ("GET", "/api/v1/get_server_capabilities", None),
        (
            "POST",
            "/api/v1/create_session",
            {"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"},
        ),
        ("GET", "/api/v1/training_runs", None),
        ("POST", "/api/v1/session_heartbeat", {"session_id": "sess-x", "type": "session_heartbeat"}),
        ("GET", "/api/v1/training_runs/sess-x:train:0", None),
        ("POST", "/api/v1/sessions/sess-x/finish", {}),
    ]:
        r = http.request(method, path, json=body, headers=H)
        assert r.status_code == 503, (path, r.status_code, r.text)
        assert int(r.headers["Retry-After"]) > 0, path
        assert "Temporal" in r.json()["detail"], (path, r.text)


def test_readiness_says_what_is_down_while_liveness_stays_up(api_without_temporal):
    http, address = api_without_temporal
    assert http.get("/api/v1/healthz").status_code == 200
    r = http.get("/api/v1/readyz")
    assert r.status_code == 503 and r.headers["Retry-After"]
    assert r.json()["unavailable"] == ["temporal"] and address in r.json()["detail"]


def test_readiness_names_a_store_that_refuses_writes(api_without_temporal, monkeypatch):
    http, _ = api_without_temporal
    store = http.app.state.services.store

    def refuse(*_a, **_k):
        raise OSError(errno.EROFS, "Read-only file system", f"{store.root}/readyz/x.partial")

    monkeypatch.setattr(store.fs, "open", refuse)
    body = http.get("/api/v1/readyz").json()
    assert body["unavailable"] == ["temporal", "store"]
    assert "the claim-check store" in body["detail"] and "read-only" in body["detail"]


def test_a_save_on_a_read_only_checkpoint_root_says_the_checkpoint_store_refused_it(tmp_path, monkeypatch):
    from tinkerflow.activities import checkpoint_io
    from tinkerflow.activities.engine_activities import EngineActivities
    from tinkerflow.common.checkpoints import CheckpointStore
    from tinkerflow.common.store import ClaimCheckStore
    from tinkerflow.workflows.protocol.messages import Batch, SaveCheckpoint, WorkItem
    from tinkerflow.workflows.protocol.work import WorkKind

    root = (tmp_path / "ckpts").as_uri()

    def read_only(*_a, **_k):  # what orbax/fsspec raise under a read-only mount (root ignores chmod here)
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "ckpts" / "s:train:0" / ".staging-1"))

    monkeypatch.setattr(checkpoint_io, "save", read_only)
    acts = EngineActivities(  # no engine: checkpoint_io.save, its one user here, is patched to fail first
        engine=cast(EngineApi, None),
        store=ClaimCheckStore((tmp_path / "store").as_uri()),
        checkpoints=CheckpointStore(root),
    )
    item = WorkItem(
        key="run#1",
        requester="run",
        kind=WorkKind.SAVE_CHECKPOINT,
        slot=0,
        save=SaveCheckpoint(
            path="tinker://s:train:0/weights/a", manifest={"tinker_path": "tinker://s:train:0/weights/a"}
        ),
    )
    (result,) = ActivityEnvironment().run(acts.run_batch, Batch(items=[item])).results
    assert result.outcome.category == "server"
    assert result.outcome.error.startswith(
        f"save_checkpoint failed: the checkpoint store ({root}) refused it: its file system is read-only"
    )
    assert ".staging" not in result.outcome.error
