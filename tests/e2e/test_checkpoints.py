"""Checkpoints end to end through the unmodified SDK: resume, PEFT export, the RestClient, the CLI.

Tolerances:
- RESUME_TOL (1e-5 relative): a resumed run repeats the original's arithmetic in float32 on CPU, but another slot and
  other runs batched alongside may change padding and so the order of some sums; measured differences are ~1e-7.
- PEFT_TOL (1e-4, as in tests/engine/test_parity.py): torch vs XLA float32 kernels over a 2-layer model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.e2e
RESUME_TOL = 1e-5
PEFT_TOL = 1e-4
ADAM = types.AdamParams(learning_rate=2e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
TOKENS = [[11, 42, 7, 99, 123, 5, 8, 301], [300, 12, 44, 13, 9, 250, 17, 3]]
DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints(t[:-1]),
        loss_fn_inputs=dict(target_tokens=t[1:], weights=[1.0] * (len(t) - 1)),  # pyright: ignore[reportArgumentType] (Datum converts lists)
    )
    for t in TOKENS
]


def step(training) -> float:
    loss = training.forward_backward(DATA, "cross_entropy").result(timeout=300).metrics["loss:sum"]
    training.optim_step(ADAM).result(timeout=300)
    return loss


@pytest.fixture(scope="module")
def rest(stack):
    return tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key).create_rest_client()


def test_resume_with_optimizer_is_exact_and_without_it_the_moments_restart(stack, base_model):
    first = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
    training = first.create_lora_training_client(base_model=base_model, rank=4, seed=3).result()
    for _ in range(2):
        step(training)
    path = training.save_state("resume-2").result(timeout=300).path
    assert path == f"tinker://{training.model_id}/weights/resume-2"
    continued = [step(training) for _ in range(3)]

    second = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
    resumed = second.create_training_client_from_state_with_optimizer(path).result(timeout=300)
    assert resumed.model_id.startswith(second.holder.get_session_id() + ":train:")
    again = [step(resumed) for _ in range(3)]
    np.testing.assert_allclose(again, continued, rtol=RESUME_TOL)

    fresh = second.create_training_client_from_state(path).result(timeout=300)
    restarted = [step(fresh) for _ in range(3)]
    # Same weights, so the first loss matches; fresh moments make the first update, and so the next loss, differ.
    np.testing.assert_allclose(restarted[0], continued[0], rtol=RESUME_TOL)
    assert abs(restarted[1] - continued[1]) > 1e-4 * abs(continued[1])
    info = fresh.get_info()
    assert info.model_data.model_name == base_model and info.lora_rank == 4


def test_legacy_in_sequence_load_replaces_the_runs_weights(stack, base_model, service_client):
    a = service_client.create_lora_training_client(base_model=base_model, rank=4, seed=1).result()
    step(a)
    path = a.save_state("legacy").result(timeout=300).path
    probe = a.forward(DATA, "cross_entropy").result(timeout=300).metrics["loss:sum"]
    b = service_client.create_lora_training_client(base_model=base_model, rank=8, seed=2).result()
    assert b.forward(DATA, "cross_entropy").result(timeout=300).metrics["loss:sum"] != pytest.approx(probe)
    with pytest.warns(Warning):  # the SDK marks load_state deprecated
        b.load_state(path).result(timeout=300)
    np.testing.assert_allclose(
        b.forward(DATA, "cross_entropy").result(timeout=300).metrics["loss:sum"], probe, rtol=RESUME_TOL
    )


def test_peft_export_reproduces_the_services_logprobs_in_transformers(
    stack, base_model, service_client, rest, tmp_path
):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    # train_unembed=False: the unembedding LoRA carries Tinker's name, which PEFT reads only through the cookbook's
    # build_lora_adapter (tests/engine/test_unembed_export.py, tests/e2e/cookbook/test_weights.py).
    training = service_client.create_lora_training_client(
        base_model=base_model, rank=4, seed=5, train_mlp=False, train_unembed=False
    ).result()
    for _ in range(3):  # non-zero B
        step(training)
    ours = training.forward(DATA, "cross_entropy").result(timeout=300).loss_fn_outputs
    saved = training.save_weights_external("hf-export").result(timeout=300)
    assert saved.path == f"tinker://{training.model_id}/external_weights/hf-export"

    urls = rest.get_external_weights_urls(saved.path).result()
    assert sorted(urls.urls) == ["adapter_config.json", "adapter_model.safetensors"]
    for name, url in urls.urls.items():
        with urllib.request.urlopen(url, timeout=60) as r:  # no API key: the URL is signed
            (tmp_path / name).write_bytes(r.read())
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["r"] == 4 and "gate_proj" not in config["target_modules"]

    base_dir = training.get_info().model_data.tokenizer_id  # the served directory (docs/wire-contract.md §Tokenizer)
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(tmp_path)).eval()
    for datum, out in zip(TOKENS, ours):
        with torch.no_grad():
            logits = model(torch.tensor([datum[:-1]])).logits[0]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(datum[1:])[:, None])[:, 0].numpy()
        np.testing.assert_allclose(np.asarray(out["logprobs"].data), ref, atol=PEFT_TOL, rtol=PEFT_TOL)


def test_named_sampler_weights_persist_and_sample_in_another_session(stack, base_model, service_client):
    training = service_client.create_lora_training_client(base_model=base_model, rank=4, seed=9).result()
    step(training)
    path = training.save_weights_for_sampler("for-later").result(timeout=300).path
    prompt = types.ModelInput.from_ints([11, 42, 7])
    params = types.SamplingParams(max_tokens=6, temperature=0.0)
    here = training.create_sampling_client(path).sample(prompt, 1, params).result(timeout=300)
    other = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
    there = other.create_sampling_client(model_path=path).sample(prompt, 1, params).result(timeout=300)
    assert there.sequences[0].tokens == here.sequences[0].tokens
    np.testing.assert_allclose(there.sequences[0].logprobs, here.sequences[0].logprobs, atol=1e-5)  # pyright: ignore[reportArgumentType, reportCallIssue] (logprobs were asked for)


def test_rest_client_runs_sessions_and_checkpoints(stack, base_model, service_client, rest):
    training = service_client.create_lora_training_client(
        base_model=base_model, rank=4, user_metadata={"renderer_name": "qwen3"}
    )
    step(training)
    run = training.model_id
    state = training.save_state("rest-1", ttl_seconds=7200).result(timeout=300).path
    sampler = training.save_weights_for_sampler("rest-s").result(timeout=300).path

    got = rest.get_training_run(run).result()
    assert (got.training_run_id, got.base_model, got.is_lora, got.lora_rank) == (run, base_model, True, 4)
    assert got.user_metadata == {"renderer_name": "qwen3"}
    assert got.last_checkpoint.tinker_path == state and got.last_sampler_checkpoint.tinker_path == sampler
    assert rest.get_training_run_by_tinker_path(state).result().training_run_id == run
    runs = rest.list_training_runs(limit=100).result()
    assert run in [r.training_run_id for r in runs.training_runs] and runs.cursor.total_count >= 1
    page = rest.list_training_runs(limit=1, offset=0).result()
    assert len(page.training_runs) == 1 and page.cursor.limit == 1

    listed = {c.tinker_path: c for c in rest.list_checkpoints(run).result().checkpoints}
    assert set(listed) == {state, sampler}
    assert listed[state].checkpoint_type == "training" and listed[sampler].checkpoint_type == "sampler"
    assert listed[state].expires_at is not None and listed[state].size_bytes > 0
    assert state in [c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints]

    info = rest.get_weights_info_by_tinker_path(state).result()
    assert (info.base_model, info.is_lora, info.lora_rank, info.train_mlp) == (base_model, True, 4, True)

    rest.publish_checkpoint_from_tinker_path(state).result()
    assert {c.tinker_path: c for c in rest.list_checkpoints(run).result().checkpoints}[state].public
    rest.unpublish_checkpoint_from_tinker_path(state).result()
    rest.set_checkpoint_ttl_from_tinker_path(state, None).result()
    assert {c.tinker_path: c for c in rest.list_checkpoints(run).result().checkpoints}[state].expires_at is None

    copy = rest.copy_weights(state, destination_project_id="archive").result()
    assert copy != state and rest.get_weights_info_by_tinker_path(copy).result().lora_rank == 4

    session_id = run.split(":")[0]
    assert session_id in rest.list_sessions(limit=1000).result().sessions
    session = rest.get_session(session_id).result()
    assert run in session.training_run_ids
    rest.assign_session_project(session_id, "pig-latin").result()
    [found] = rest.search_sessions(types.SessionSearchRequest(session_id=session_id)).result().sessions
    assert (found.session_id, found.project_id, found.status.type) == (session_id, "pig-latin", "active")
    assert found.checkpoints_count >= 2 and found.checkpoint_storage_bytes > 0
    finished = types.SessionSearchRequest(statuses=[types.ClientFinishedSessionStatusQuery()])
    assert session_id not in [s.session_id for s in rest.search_sessions(finished).result().sessions]
    with pytest.raises(Exception, match="not supported"):
        rest.export_session_trace(session_id).result()

    # Deleting removes the files at once; the path no longer lists, loads or samples.
    ckpt_dir = stack.state_dir / "checkpoints" / run / "weights" / "rest-1"
    assert (ckpt_dir / "checkpoint.json").exists()
    rest.delete_checkpoint_from_tinker_path(state).result()
    assert not ckpt_dir.exists()
    assert state not in [c.tinker_path for c in rest.list_checkpoints(run).result().checkpoints]
    with pytest.raises(tinker.RequestFailedError, match="does not exist"):
        service_client.create_training_client_from_state(state).result(timeout=300)
    rest.delete_checkpoint(run, "sampler_weights/rest-s").result()
    with pytest.raises(tinker.NotFoundError):
        service_client.create_sampling_client(model_path=sampler).result()


@pytest.mark.parametrize(
    "path, message",
    [
        ("tinker://x", "malformed"),
        ("tinker://nobody:train:0/weights/nothing", "does not exist"),
        ("tinker://a:train:0/secrets/x", "unknown checkpoint kind"),
    ],
)
def test_loading_a_bad_path_fails_with_a_user_error(service_client, path, message):
    with pytest.raises(tinker.RequestFailedError, match=message) as e:
        service_client.create_training_client_from_state(path).result(timeout=300)
    assert str(e.value.category).lower().endswith("user")


def test_bad_saves_fail_their_future_and_the_run_goes_on(training_client):
    with pytest.raises(tinker.RequestFailedError, match="already exists"):
        training_client.save_state("dup").result(timeout=300)
        training_client.save_state("dup").result(timeout=300)
    with pytest.raises(tinker.RequestFailedError, match="ttl_seconds"):
        training_client.save_state("short", ttl_seconds=5).result(timeout=300)
    assert training_client.save_state("dup", overwrite=True).result(timeout=300).path.endswith("/weights/dup")
    training_client.forward(DATA, "cross_entropy").result(timeout=300)


def test_tinker_cli_lists_and_downloads(stack, training_client, tmp_path):
    path = training_client.save_weights_external("cli-export").result(timeout=300).path
    state = training_client.save_state("cli-state", overwrite=True).result(timeout=300).path
    env = dict(os.environ, TINKER_BASE_URL=stack.base_url, TINKER_API_KEY=stack.api_key, TINKER_TELEMETRY="0")

    def cli(*args: str) -> subprocess.CompletedProcess:
        run = subprocess.run(
            [sys.executable, "-m", "tinker.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        return run

    listed = json.loads(cli("--format", "json", "checkpoint", "list", "--run-id", training_client.model_id).stdout)
    assert {path, state} <= {c["tinker_path"] for c in listed["checkpoints"]}
    cli("checkpoint", "download", path, "--output", str(tmp_path / "ext"))
    got = tmp_path / "ext" / path.replace("tinker://", "").replace("/", "_")
    assert sorted(p.name for p in got.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    # A training checkpoint downloads through a temporary export the CLI makes and deletes again.
    cli("checkpoint", "download", state, "--output", str(tmp_path / "state"))
    got = tmp_path / "state" / state.replace("tinker://", "").replace("/", "_")
    assert (got / "adapter_model.safetensors").stat().st_size > 0
    assert Path(got / "adapter_config.json").exists()
