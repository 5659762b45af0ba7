"""docs/architecture.md §What durability promises, on the real parts, each its own process: kill one, start it again,
and nothing the SDK was told is lost.

The parts are started with the same machinery as `tinkerflow up` (one process each), so a test can kill exactly one.
"""

from __future__ import annotations

import signal
import time

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tinkerflow.cli.launch import free_port
from tinkerflow.cli.up import Stack
from tinkerflow.common.settings import Settings

pytestmark = pytest.mark.e2e
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([10, 20, 30, 40]),
    loss_fn_inputs=dict(target_tokens=[20, 30, 40, 50], weights=[1.0, 1.0, 1.0, 1.0]),  # pyright: ignore[reportArgumentType] (Datum converts lists)
)
ADAM = types.AdamParams(learning_rate=1e-3)


@pytest.fixture
def parts(tmp_path, request):
    """The stack as separate parts; the param: automatic snapshots every N optim steps, or (N, adapter slots)."""
    temporal_port = free_port()
    param = getattr(request, "param", 10)
    snapshot_every, slots = (param, Settings().max_lora_adapters) if isinstance(param, int) else param
    settings = Settings(
        state_dir=tmp_path / "state",
        port=free_port(),
        api_keys=("tml-durable",),
        temporal_address=f"127.0.0.1:{temporal_port}",
        auto_snapshot_every=snapshot_every,
        max_lora_adapters=slots,
    )
    stack = Stack(settings)
    stack.temporal_port = temporal_port  # pyright: ignore[reportAttributeAccessIssue] (test instrumentation)
    try:
        stack.start_temporal(temporal_port, 0, headless=True)
        stack.start_worker("workflow-worker")
        stack.start_worker("jax-worker")
        stack.start_api()
        yield stack
    finally:
        stack.stop()


def _client(stack: Stack):
    service = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
    training = service.create_lora_training_client(base_model=stack.served_model(), rank=4).result()
    training.forward_backward([DATUM], "cross_entropy").result(timeout=300)  # compiles before any fault
    training.optim_step(ADAM).result(timeout=300)
    return training


def _losses(futures) -> list[float]:
    return [f.result(timeout=300).metrics["loss:sum"] for f in futures]


def test_api_killed_and_restarted_mid_run_every_future_resolves(parts):
    training = _client(parts)
    futures = [training.forward_backward([DATUM], "cross_entropy") for _ in range(3)]
    optim = training.optim_step(ADAM)
    parts.kill("api")
    parts.start_api()
    assert len(_losses(futures)) == 3
    assert optim.result(timeout=300).metrics is not None  # a failed future would raise here
    # and the run goes on: seq order intact, the next step lowers the loss on this datum
    before = _losses([training.forward_backward([DATUM], "cross_entropy")])[0]
    training.optim_step(ADAM).result(timeout=300)
    after = _losses([training.forward_backward([DATUM], "cross_entropy")])[0]
    assert after < before


def test_workflow_worker_killed_only_delays(parts):
    training = _client(parts)
    futures = [training.forward_backward([DATUM], "cross_entropy") for _ in range(2)]
    parts.kill("workflow-worker")
    parts.start_worker("workflow-worker")
    assert len(_losses(futures)) == 2
    assert training.optim_step(ADAM).result(timeout=300) is not None


def test_temporal_restarted_on_its_file_keeps_sessions_runs_and_futures(parts):
    training = _client(parts)
    done = training.forward_backward([DATUM], "cross_entropy")
    first = _losses([done])[0]
    parts.kill("temporal", signal.SIGTERM)
    parts.start_temporal(parts.temporal_port, 0, headless=True)
    # the answered future is still answerable, and the same training client keeps training in order
    assert _losses([done])[0] == first
    assert len(_losses([training.forward_backward([DATUM], "cross_entropy")])) == 1
    assert training.optim_step(ADAM).result(timeout=300) is not None


def test_a_save_cut_short_by_a_killed_jax_worker_leaves_nothing_that_lists_or_loads(parts, monkeypatch):
    """The worker is held between uploading the payload and committing the manifest (fault injection), then killed.
    The files it left never list and never load; once a worker is back the run restores its adapter and the save
    runs again, whole this time."""
    training = _client(parts)
    parts.kill("jax-worker")
    monkeypatch.setenv("TINKERFLOW_FAULT_PAUSE_BEFORE_COMMIT_S", "120")
    parts.start_worker("jax-worker")
    training = _client(parts)  # the restarted worker lost the first adapter; a new run on the new worker
    run, name = training.model_id, "half"
    path = f"tinker://{run}/weights/{name}"
    ckpt_dir = parts.settings.state_dir / "checkpoints" / run / "weights" / name
    pending = training.save_state(name)
    deadline = time.monotonic() + 120
    while not (ckpt_dir.exists() and any(p.is_file() for p in ckpt_dir.rglob("*"))):
        assert time.monotonic() < deadline, parts.logs
        time.sleep(0.1)
    parts.kill("jax-worker")

    assert not (ckpt_dir / "checkpoint.json").exists()
    rest = tinker.ServiceClient(base_url=parts.base_url, api_key=parts.api_key).create_rest_client()
    assert path not in [c.tinker_path for c in rest.list_checkpoints(run).result().checkpoints]
    service = tinker.ServiceClient(base_url=parts.base_url, api_key=parts.api_key)
    with pytest.raises(tinker.RequestFailedError, match="does not exist"):
        service.create_training_client_from_state(path).result(timeout=120)

    monkeypatch.delenv("TINKERFLOW_FAULT_PAUSE_BEFORE_COMMIT_S")
    parts.start_worker("jax-worker")
    assert pending.result(timeout=300).path == path
    assert (ckpt_dir / "checkpoint.json").exists()
    assert path in [c.tinker_path for c in rest.list_checkpoints(run).result().checkpoints]
    assert service.create_training_client_from_state(path).result(timeout=120).get_info().lora_rank == 4


@pytest.mark.parametrize("parts", [2], indirect=True)  # an automatic snapshot every 2 optim steps
def test_jax_worker_killed_mid_run_the_run_is_restored_exactly_and_no_future_hangs(parts):
    """kill -9 the JAX worker with work in flight and start it again: the run's adapter is restored from its latest
    automatic snapshot plus the ops since, so the losses continue exactly as in a run that never saw a fault; a
    sample in flight completes or fails with a message, and nothing hangs."""
    service = tinker.ServiceClient(base_url=parts.base_url, api_key=parts.api_key)
    model = parts.served_model()

    def steps(training, n: int) -> list[float]:
        out = []
        for _ in range(n):
            out.append(_losses([training.forward_backward([DATUM], "cross_entropy")])[0])
            training.optim_step(ADAM).result(timeout=300)
        return out

    reference = service.create_lora_training_client(base_model=model, rank=4, seed=11).result()
    expected = steps(reference, 6)

    training = service.create_lora_training_client(base_model=model, rank=4, seed=11).result()
    before = steps(training, 3)  # snapshot after step 2; step 3's ops are logged since
    sampler = training.save_weights_and_get_sampling_client()
    in_flight = [training.forward_backward([DATUM], "cross_entropy"), training.optim_step(ADAM)]
    sample = sampler.sample(types.ModelInput.from_ints([10, 20]), 1, types.SamplingParams(max_tokens=4))
    parts.kill("jax-worker")
    parts.start_worker("jax-worker")

    after = [_losses([in_flight[0]])[0]]
    in_flight[1].result(timeout=300)
    after += steps(training, 2)
    np.testing.assert_allclose(before + after, expected, rtol=1e-5)
    # Its snapshot lived on the dead worker: sent again and answered from the snapshot's copy (the test below).
    assert len(sample.result(timeout=300).sequences[0].tokens) == 4


def test_every_kind_of_sampling_client_answers_the_same_after_the_jax_worker_is_killed(parts):
    """kill -9 the JAX worker while an ephemeral (save_weights_and_get_sampling_client), a named (a sampler
    checkpoint's path) and a base-model sampling client are live and each has samples in flight: every in-flight
    sample is answered, and every client samples the same tokens for the same seed as before the kill (the ephemeral
    snapshot is loaded on the successor from the copy its snapshot op wrote; lost calls are sent again once)."""
    service = tinker.ServiceClient(base_url=parts.base_url, api_key=parts.api_key)
    training = _client(parts)  # one step: the adapter's weights are no longer LoRA's zero-B init
    named_path = training.save_weights_for_sampler(name="durable").result(timeout=300).path
    clients = {
        "ephemeral": training.save_weights_and_get_sampling_client().result(timeout=300),
        "named": service.create_sampling_client(model_path=named_path),
        "base": service.create_sampling_client(base_model=parts.served_model()),
    }
    prompt = types.ModelInput.from_ints([10, 20, 30])
    params = types.SamplingParams(max_tokens=6, seed=7, temperature=1.0)

    def tokens(future) -> list[list[int]]:
        return [s.tokens for s in future.result(timeout=300).sequences]

    before = {name: tokens(c.sample(prompt, 2, params)) for name, c in clients.items()}
    in_flight = {name: [c.sample(prompt, 2, params) for _ in range(3)] for name, c in clients.items()}
    parts.kill("jax-worker")
    parts.start_worker("jax-worker")
    for name, futures in in_flight.items():
        assert [tokens(f) for f in futures] == [before[name]] * 3, name
    after = {name: tokens(c.sample(prompt, 2, params)) for name, c in clients.items()}
    assert after == before


@pytest.mark.parametrize("parts", [(2, 2)], indirect=True)  # snapshots every 2 optim steps; 2 adapter slots
def test_jax_worker_killed_with_runs_paged_out_restores_every_run_exactly(parts):
    """Five runs on two slots, trained round-robin, so three are paged out (host memory) when the JAX worker is
    killed -9: every run is restored from its snapshot plus the ops since, on the restarted worker and again through
    its two slots, and each continues with the losses of a run of its seed that never saw a fault. rtol 1e-5 as
    above: the runs share forward_backward batches differently than their references did (packed rows, padding
    buckets); bit-identity of paging itself is tests/engine/test_adapter_paging.py's."""
    service = tinker.ServiceClient(base_url=parts.base_url, api_key=parts.api_key)
    model = parts.served_model()
    seeds = [21, 22, 23, 24, 25]

    def step(training) -> float:
        loss = _losses([training.forward_backward([DATUM], "cross_entropy")])[0]
        training.optim_step(ADAM).result(timeout=300)
        return loss

    expected = {}
    for seed in seeds:
        reference = service.create_lora_training_client(base_model=model, rank=4, seed=seed).result()
        expected[seed] = [step(reference) for _ in range(5)]

    runs = {seed: service.create_lora_training_client(base_model=model, rank=4, seed=seed).result() for seed in seeds}
    got: dict[int, list[float]] = {seed: [] for seed in seeds}
    for _ in range(3):  # a snapshot after step 2, step 3's ops logged since; round-robin pages every run in and out
        for seed, training in runs.items():
            got[seed].append(step(training))
    http = httpx.Client(base_url=parts.base_url, headers={"X-API-Key": parts.api_key}, timeout=30)
    (served,) = http.get("/api/v1/console/service").json()["models"]
    assert served["slots_used"] == 2 and served["runs_paged"] >= 3 + len(seeds)  # references and runs alike

    parts.kill("jax-worker")
    parts.start_worker("jax-worker")
    for _ in range(2):
        for seed, training in runs.items():
            got[seed].append(step(training))
    for seed in seeds:
        np.testing.assert_allclose(got[seed], expected[seed], rtol=1e-5, err_msg=f"seed {seed}")
