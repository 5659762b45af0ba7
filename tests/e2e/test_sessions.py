"""Slots are finite and sessions are leased: a full server says so clearly, and an abandoned session gives its
slots back after the heartbeat timeout (docs/architecture.md §What durability promises)."""

from __future__ import annotations

import time

import httpx
import pytest
import tinker

from tinkerflow.cli.launch import launch

pytestmark = pytest.mark.e2e


def _raw_session(http: httpx.Client) -> str:
    """A session that never heartbeats (the SDK would, every 10 s): what a crashed client leaves behind."""
    return http.post(
        "/api/v1/create_session",
        json={"tags": ["abandoned"], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"},
    ).json()["session_id"]


def _create(http: httpx.Client, session_id: str, n: int, base_model: str) -> dict:
    return _await(
        http,
        http.post(
            "/api/v1/create_model",
            json={
                "session_id": session_id,
                "model_seq_id": n,
                "base_model": base_model,
                "lora_config": {"rank": 4},
                "type": "create_model",
            },
        ).json()["request_id"],
    )


def _await(http: httpx.Client, request_id: str) -> dict:
    for _ in range(40):
        r = http.post(
            "/api/v1/retrieve_future", json={"request_id": request_id, "allow_metadata_only": False}, timeout=60
        ).json()
        if r.get("type") != "try_again":
            return r
    raise AssertionError(f"{request_id} never answered")


def test_a_tenant_at_its_live_run_limit_is_told_so_and_an_abandoned_session_frees_its_runs(tmp_path):
    """Runs beyond the adapter slots are paged out, so what bounds a tenant is --max-live-runs-per-tenant: past it a
    create fails with a clear user error, and the runs of a session the client abandoned stop counting once it
    times out."""
    stack = launch(
        tmp_path / "state",
        api_key="tml-slots",
        extra=["--max-lora-adapters", "1", "--max-live-runs-per-tenant", "2", "--session-timeout-s", "6"],
    )
    try:
        http = httpx.Client(base_url=stack.base_url, headers={"X-API-Key": stack.api_key})
        model = stack.served_model()
        abandoned = _raw_session(http)
        created_at = time.monotonic()
        assert _create(http, abandoned, 0, model)["model_id"] == f"{abandoned}:train:0"
        assert _create(http, abandoned, 1, model)["model_id"] == f"{abandoned}:train:1"
        kept = _await(
            http,
            http.post(
                "/api/v1/save_weights",
                json={"model_id": f"{abandoned}:train:0", "path": "kept", "seq_id": 1, "type": "save_weights"},
            ).json()["request_id"],
        )["path"]

        service = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
        t0 = time.monotonic()
        with pytest.raises(tinker.RequestFailedError, match="already holds 2 live training runs"):
            service.create_lora_training_client(base_model=model, rank=4).result(timeout=60)
        assert time.monotonic() - t0 < 30  # an answer, not a hang

        # No heartbeats for 6 s: the session ends and closes its runs, which no longer count for the next client.
        deadline = time.monotonic() + 60
        while True:
            try:
                training = service.create_lora_training_client(base_model=model, rank=4).result(timeout=60)
                break
            except tinker.RequestFailedError:
                assert time.monotonic() < deadline, "the abandoned session's runs never stopped counting"
                time.sleep(1)
        assert time.monotonic() - created_at >= 5
        r = http.post("/api/v1/session_heartbeat", json={"session_id": abandoned, "type": "session_heartbeat"})
        assert r.status_code == 410 and r.json()["detail"]
        # The console reads that normal end of a client as "ended" with its reason, never as an error.
        sessions = http.get("/api/v1/console/sessions", params={"q": abandoned}).json()["sessions"]
        assert [(s["status"], s["reason"]) for s in sessions] == [
            ("ended", "the client went away (no heartbeat for 6s)")
        ]
        run = http.get(f"/api/v1/console/runs/{abandoned}:train:1").json()
        assert (
            run["status"] == "ended"
            and run["reason"] == "its session ended: the client went away (no heartbeat for 6s)"
        )
        assert training.get_info().model_data.model_name == model
        # ... and its checkpoints stay: listed, and loadable into a new run (its one slot paged as needed).
        rest = tinker.RestClient(base_url=stack.base_url, api_key=stack.api_key)
        assert kept in [c.tinker_path for c in rest.list_checkpoints(f"{abandoned}:train:0").result().checkpoints]
        assert service.create_training_client_from_state(kept).result(timeout=120).get_info().lora_rank == 4
    finally:
        stack.stop()
