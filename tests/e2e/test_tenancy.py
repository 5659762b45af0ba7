"""One tenant cannot read, train, sample or end another's runs, samplers or sessions."""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types

from tinkerflow.cli.launch import launch

pytestmark = pytest.mark.e2e
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([10, 20, 30]),
    loss_fn_inputs=dict(target_tokens=[20, 30, 40], weights=[1.0, 1.0, 1.0]),  # pyright: ignore[reportArgumentType] (Datum converts lists)
)


def test_tenants_are_isolated_and_keys_come_from_flags_and_a_file(tmp_path):
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("# tenants\ntml-bob  # from the file\n")
    stack = launch(tmp_path / "state", api_key="tml-alice", extra=["--api-keys-file", str(keys_file)])
    try:
        alice = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-alice")
        training = alice.create_lora_training_client(base_model=stack.served_model(), rank=4).result()
        training.forward_backward([DATUM], "cross_entropy").result(timeout=300)
        sampler = training.save_weights_and_get_sampling_client()
        model_id = training.model_id
        session_id = model_id.split(":")[0]
        # the session's first sampling session (docs/wire-contract.md §Ids and paths)
        sampler_id = f"{session_id}:sample:0"

        bob = httpx.Client(base_url=stack.base_url, headers={"X-API-Key": "tml-bob"})
        assert bob.post("/api/v1/get_info", json={"model_id": model_id, "type": "get_info"}).status_code == 404
        r = bob.post(
            "/api/v1/optim_step",
            json={
                "model_id": model_id,
                "seq_id": 99,
                "type": "optim_step",
                "adam_params": {
                    "learning_rate": 1.0,
                    "beta1": 0.9,
                    "beta2": 0.95,
                    "eps": 1e-12,
                    "weight_decay": 0.0,
                    "grad_clip_norm": 0.0,
                },
            },
        )
        assert r.status_code == 404 and "does not exist" in r.json()["detail"]
        r = bob.post(
            "/api/v1/create_model",
            json={
                "session_id": session_id,
                "model_seq_id": 7,
                "base_model": stack.served_model(),
                "type": "create_model",
            },
        )
        assert r.status_code == 404
        assert bob.get(f"/api/v1/samplers/{sampler_id}").status_code == 404
        r = bob.post(
            "/api/v1/asample",
            json={
                "num_samples": 1,
                "prompt": {"chunks": [{"tokens": [1, 2], "type": "encoded_text"}]},
                "sampling_params": {"max_tokens": 2},
                "sampling_session_id": sampler_id,
                "seq_id": 0,
                "type": "sample",
            },
        )
        assert r.status_code == 404
        assert (
            bob.post(
                f"/api/v1/sessions/{session_id}/finish", json={"reason": {"type": "success"}, "detail": None}
            ).status_code
            == 404
        )
        assert bob.post("/api/v1/client/config", json={"sdk_version": "0.38.0"}).status_code == 200  # bob is valid

        # Checkpoints: private ones are invisible to bob (404, like a missing one); published ones he can read and
        # load, but only alice can change or delete them (403).
        path = training.save_state("alice-1").result(timeout=300).path
        ckpt = f"/api/v1/training_runs/{model_id}/checkpoints/weights/alice-1"
        assert bob.get(f"/api/v1/training_runs/{model_id}/checkpoints").json()["checkpoints"] == []
        assert path not in str(bob.get("/api/v1/checkpoints").json())
        assert bob.post("/api/v1/weights_info", json={"tinker_path": path}).status_code == 404
        assert bob.delete(ckpt).status_code == 404
        assert bob.get(f"{ckpt}/external_weights_urls").status_code == 404
        bob_sdk = tinker.ServiceClient(base_url=stack.base_url, api_key="tml-bob")
        with pytest.raises(tinker.RequestFailedError, match="does not exist"):
            bob_sdk.create_training_client_from_state(path).result(timeout=300)
        alice_rest = alice.create_rest_client()
        alice_rest.publish_checkpoint_from_tinker_path(path).result()
        assert bob.post("/api/v1/weights_info", json={"tinker_path": path}).json()["lora_rank"] == 4
        assert bob_sdk.create_training_client_from_state(path).result(timeout=300).get_info().lora_rank == 4
        assert (
            bob.delete(ckpt).status_code == 403
            and bob.put(f"{ckpt}/ttl", json={"ttl_seconds": 3600}).status_code == 403
        )
        assert path in [c.tinker_path for c in alice_rest.list_checkpoints(model_id).result().checkpoints]
        bobs_runs = [r["training_run_id"] for r in bob.get("/api/v1/training_runs").json()["training_runs"]]
        assert len(bobs_runs) == 1 and model_id not in bobs_runs  # only the run bob made from the published one

        # Alice is untouched: her run is at the step she left it, and she keeps training and sampling.
        out = training.forward_backward([DATUM], "cross_entropy").result(timeout=300)
        assert len(out.loss_fn_outputs[0]["logprobs"].tolist()) == 3
        result = sampler.sample(
            prompt=types.ModelInput.from_ints([1, 2]), num_samples=1, sampling_params=types.SamplingParams(max_tokens=3)
        ).result(timeout=300)
        assert len(result.sequences[0].tokens) >= 1
    finally:
        stack.stop()
