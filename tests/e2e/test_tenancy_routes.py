"""Two tenants on one stack: bob walks every route of the API with alice's ids (runs, sessions,
samplers, futures real and forged, checkpoints private and published, copies into her namespace) and gets 404 for
what he must not see, 403 for what he may read but not change; alice's data is unchanged afterwards (the bytes of
her checkpoints, her run's logprobs on the next step), and she keeps working.

Runs on the session's shared stack, which accepts a second key for this (`OTHER_API_KEY`).
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.e2e.conftest import API_KEY, OTHER_API_KEY

pytestmark = pytest.mark.e2e
ALICE, BOB = API_KEY, OTHER_API_KEY  # two tenants of the session's shared stack
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([10, 20, 30]),
    loss_fn_inputs=dict(target_tokens=[20, 30, 40], weights=[1.0, 1.0, 1.0]),  # pyright: ignore[reportArgumentType] (Datum converts lists)
)
ADAM = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
SAMPLE = {
    "num_samples": 1,
    "prompt": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]},
    "sampling_params": {"max_tokens": 2, "seed": 3},
    "type": "sample",
}


def _rest(stack, key) -> httpx.Client:
    return httpx.Client(base_url=stack.base_url, headers={"X-API-Key": key}, timeout=120)


def _poll(client: httpx.Client, request_id: str, tries: int = 20) -> dict:
    for _ in range(tries):
        r = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert r.status_code == 200, r.text
        if r.headers.get("content-type", "").startswith("application/json") and r.json().get("type") == "try_again":
            continue
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else {"bytes": r.content}
    raise AssertionError(f"future {request_id} never resolved")


def _files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_bob_gets_nothing_of_alices_and_changes_nothing(stack):
    model = stack.served_model()
    alice_sdk = tinker.ServiceClient(base_url=stack.base_url, api_key=ALICE)
    training = alice_sdk.create_lora_training_client(base_model=model, rank=4).result(timeout=300)
    training.forward_backward([DATUM], "cross_entropy").result(timeout=300)
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=300)
    private = training.save_state("private").result(timeout=300).path
    published = training.save_state("published").result(timeout=300).path
    sampler_path = training.save_weights_for_sampler("s1").result(timeout=300).path
    tinker.RestClient(base_url=stack.base_url, api_key=ALICE).publish_checkpoint_from_tinker_path(published).result()
    run = training.model_id
    session = run.split(":")[0]
    sampling = training.create_sampling_client(sampler_path).result(timeout=300)
    sampling.sample(
        prompt=types.ModelInput.from_ints([1, 2]), num_samples=1, sampling_params=types.SamplingParams(max_tokens=2)
    ).result(timeout=300)
    before = training.forward([DATUM], "cross_entropy").result(timeout=300).loss_fn_outputs[0]["logprobs"].tolist()

    alice, bob = _rest(stack, ALICE), _rest(stack, BOB)
    [sampler_id] = alice.get(f"/api/v1/sessions/{session}").json()["sampler_ids"]
    # Alice's own futures, made over REST so their request ids are at hand.
    assert alice.get(f"/api/v1/samplers/{sampler_id}").status_code == 200
    asample = alice.post("/api/v1/asample", json={**SAMPLE, "sampling_session_id": sampler_id, "seq_id": 900})
    asample_rid = asample.json()["request_id"]
    info = alice.post("/api/v1/get_info", json={"model_id": run}).json()
    assert info["lora_rank"] == 4
    ckpt_root = stack.state_dir / "checkpoints" / run
    bytes_before = _files(ckpt_root)

    def forged(kind: str, payload) -> str:  # the unsigned encoding request ids once had
        return kind + "." + base64.urlsafe_b64encode(json.dumps(payload).encode()).decode().rstrip("=")

    cases: list[tuple[str, int, httpx.Response]] = []

    def expect(what: str, status: int, response: httpx.Response) -> None:
        cases.append((what, status, response))

    p404 = f"/api/v1/training_runs/{run}/checkpoints/weights/private"
    p403 = f"/api/v1/training_runs/{run}/checkpoints/weights/published"
    # runs
    expect("get_info", 404, bob.post("/api/v1/get_info", json={"model_id": run}))
    expect(
        "optim_step",
        404,
        bob.post("/api/v1/optim_step", json={"model_id": run, "seq_id": 99, "adam_params": ADAM, "type": "optim_step"}),
    )
    for route, extra in (
        ("save_weights", {"path": "bobs"}),
        ("save_weights_for_sampler", {"path": "bobs"}),
        ("save_weights_external", {"path": "bobs"}),
        ("load_weights", {"path": published, "optimizer": False}),
    ):
        expect(route, 404, bob.post(f"/api/v1/{route}", json={"model_id": run, "seq_id": 99, **extra}))
    expect("GET training_run", 404, bob.get(f"/api/v1/training_runs/{run}"))
    # sessions
    expect("GET session", 404, bob.get(f"/api/v1/sessions/{session}"))
    expect("trace_export", 404, bob.get(f"/api/v1/sessions/{session}/trace_export"))
    expect("assign project", 404, bob.put(f"/api/v1/sessions/{session}/project", json={"project_id": "p"}))
    expect("finish", 404, bob.post(f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "success"}}))
    expect(
        "heartbeat (the answer for an unknown session)",
        410,
        bob.post("/api/v1/session_heartbeat", json={"session_id": session}),
    )
    expect(
        "create_model in her session",
        404,
        bob.post(
            "/api/v1/create_model",
            json={"session_id": session, "model_seq_id": 7, "base_model": model, "type": "create_model"},
        ),
    )
    expect(
        "create-via-load in her session",
        404,
        bob.post(
            "/api/v1/load_weights",
            json={"session_id": session, "model_seq_id": 8, "path": published, "optimizer": False},
        ),
    )
    expect(
        "create_sampling_session in her session",
        404,
        bob.post(
            "/api/v1/create_sampling_session",
            json={"session_id": session, "sampling_session_seq_id": 5, "base_model": model},
        ),
    )
    # samplers
    expect("GET sampler", 404, bob.get(f"/api/v1/samplers/{sampler_id}"))
    expect("asample", 404, bob.post("/api/v1/asample", json={**SAMPLE, "sampling_session_id": sampler_id, "seq_id": 0}))
    # futures: real ones of hers, and ids built from her model_id the old way
    expect("her asample future", 404, bob.post("/api/v1/retrieve_future", json={"request_id": asample_rid}))
    for rid in (
        forged("u", [f"training-run/{run}", "", "create"]),
        forged("w", f"training-run/{run}"),
        asample_rid.rsplit(".", 1)[0],
    ):
        expect(f"forged future {rid[:30]}", 404, bob.post("/api/v1/retrieve_future", json={"request_id": rid}))
    # private checkpoints: as if missing
    expect("weights_info private", 404, bob.post("/api/v1/weights_info", json={"tinker_path": private}))
    expect("delete private", 404, bob.delete(p404))
    expect("publish private", 404, bob.post(f"{p404}/publish"))
    expect("unpublish private", 404, bob.delete(f"{p404}/publish"))
    expect("ttl private", 404, bob.put(f"{p404}/ttl", json={"ttl_seconds": 3600}))
    expect("urls private", 404, bob.get(f"{p404}/external_weights_urls"))
    expect("copy private", 404, bob.post("/api/v1/copy_weights", json={"source_path": private}))
    # published checkpoints: readable, not changeable
    expect("weights_info published", 200, bob.post("/api/v1/weights_info", json={"tinker_path": published}))
    expect("urls published", 200, bob.get(f"{p403}/external_weights_urls"))
    expect("delete published", 403, bob.delete(p403))
    expect("unpublish published", 403, bob.delete(f"{p403}/publish"))
    expect("publish published", 403, bob.post(f"{p403}/publish"))
    expect("ttl published", 403, bob.put(f"{p403}/ttl", json={"ttl_seconds": 3600}))
    # copies: into her namespace never; into his own, yes
    run_seq = int(run.rsplit(":", 1)[1])
    expect(
        "copy into her run",
        404,
        bob.post(
            "/api/v1/copy_weights", json={"source_path": published, "session_id": session, "model_seq_id": run_seq}
        ),
    )
    own = bob.post("/api/v1/copy_weights", json={"source_path": published})
    expect("copy into his own namespace", 200, own)
    # the owner's bytes answer only the owner (signed download URLs are checked in test_checkpoints)

    wrong = [(what, status, r.status_code, r.text[:200]) for what, status, r in cases if r.status_code != status]
    assert not wrong, wrong
    assert not own.json()["tinker_path"].startswith(f"tinker://{run}/")

    # listings show him nothing of hers
    assert run not in bob.get("/api/v1/training_runs").text
    assert session not in bob.get("/api/v1/sessions").text
    assert run not in bob.get("/api/v1/checkpoints").text
    listed = bob.get(f"/api/v1/training_runs/{run}/checkpoints").json()["checkpoints"]
    assert [c["tinker_path"] for c in listed] == [published]
    assert bob.post("/api/v1/sessions/search", json={"session_id": session}).json()["sessions"] == []

    # his own futures answer him and not her
    bob_sdk = tinker.ServiceClient(base_url=stack.base_url, api_key=BOB)
    bob_session = bob.post(
        "/api/v1/create_session", json={"tags": [], "user_metadata": None, "sdk_version": "0.38.0"}
    ).json()["session_id"]
    created = bob.post(
        "/api/v1/create_model",
        json={"session_id": bob_session, "model_seq_id": 0, "base_model": model, "lora_config": {"rank": 2}},
    )
    bob_rid = created.json()["request_id"]
    assert alice.post("/api/v1/retrieve_future", json={"request_id": bob_rid}).status_code == 404
    assert "error" not in _poll(bob, bob_rid)
    assert bob_sdk.get_server_capabilities().supported_models

    # alice: bytes, numbers and service unchanged
    assert _files(ckpt_root) == bytes_before
    after = training.forward([DATUM], "cross_entropy").result(timeout=300).loss_fn_outputs[0]["logprobs"].tolist()
    assert after == before
    assert "error" not in _poll(alice, asample_rid)
    assert training.save_state("final").result(timeout=300).path.endswith("/weights/final")
    assert alice.post("/api/v1/session_heartbeat", json={"session_id": session}).status_code == 200
    print(f"cross-tenant cases: {len(cases)}")
    # Give the shared stack its adapter slots back.
    for client, sid in ((bob, bob_session), (alice, session)):
        assert client.post(f"/api/v1/sessions/{sid}/finish", json={"reason": {"type": "success"}}).status_code == 200


def test_metrics_and_docs_are_closed_by_default(stack):
    assert httpx.get(f"{stack.base_url}/metrics").status_code == 401
    assert httpx.get(f"{stack.base_url}/metrics", headers={"X-API-Key": "tml-nobody"}).status_code == 401
    assert httpx.get(f"{stack.base_url}/metrics", headers={"X-API-Key": BOB}).status_code == 200
    assert httpx.get(f"{stack.base_url}/metrics", headers={"Authorization": f"Bearer {BOB}"}).status_code == 200
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(f"{stack.base_url}{path}").status_code == 404
