"""Per-run metric points through the real stack (docs/metrics.md): the SDK trains, the route answers its points.

N forward_backward + optim_step on a run give N points of each op with finite losses; a forward and a sample call on
the run's weights add a point each; another tenant gets 404 (the same body as an unknown run); bad paging parameters
are 400; the JAX worker's /metrics shows MFU and FLOPs after a step; the points are still there after the API process
is killed and `up` restarts it (they live in the store, not in the API).
"""

from __future__ import annotations

import math
import time

import httpx
import jax
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from tests.e2e.conftest import API_KEY, OTHER_API_KEY

pytestmark = pytest.mark.e2e
N = 3
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([10, 20, 30, 40]),
    loss_fn_inputs=dict(target_tokens=[20, 30, 40, 50], weights=[1.0, 1.0, 1.0, 1.0]),  # pyright: ignore[reportArgumentType] (Datum converts lists)
)


def _get(stack, run: str, key: str = API_KEY, params: dict[str, int | str] | None = None) -> httpx.Response:
    return httpx.get(
        f"{stack.base_url}/api/v1/training_runs/{run}/metrics", params=params, headers={"X-API-Key": key}, timeout=120
    )


def _all_points(stack, run: str, limit: int) -> list[dict]:
    points: list[dict] = []
    after: int | None = -1
    while after is not None:
        r = _get(stack, run, params={"after": after, "limit": limit})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["training_run_id"] == run
        points += body["points"]
        after = body["next_after"]
    return points


@pytest.fixture(scope="module")
def training(service_client, base_model):
    """A run of N forward_backward + optim_step on one datum."""
    client = service_client.create_lora_training_client(base_model=base_model, rank=4).result()
    for _ in range(N):
        client.forward_backward([DATUM], "cross_entropy").result(timeout=300)
        client.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=300)
    return client


@pytest.fixture(scope="module")
def trained(training) -> str:
    return training.model_id


def test_n_steps_give_n_points_of_each_op(stack, trained):
    points = _all_points(stack, trained, limit=2)  # pages of 2: paging is part of what is checked
    assert [p["index"] for p in points] == list(range(2 * N))
    fb = [p for p in points if p["op"] == "forward_backward"]
    opt = [p for p in points if p["op"] == "optim_step"]
    assert len(fb) == N and len(opt) == N
    assert [p["step"] for p in fb] == list(range(N)) and [p["step"] for p in opt] == list(range(N))
    assert all(isinstance(p["metrics"]["loss:sum"], float) and math.isfinite(p["metrics"]["loss:sum"]) for p in fb)
    assert all(p["metrics"]["tokens"] == 4 for p in fb)
    assert all(p["metrics"]["learning_rate"] == pytest.approx(1e-3) and p["metrics"]["grad_norm"] > 0 for p in opt)
    seqs = [p["seq_id"] for p in points]
    assert seqs == sorted(seqs) and len(set(seqs)) == 2 * N
    assert fb[-1]["metrics"]["loss:sum"] < fb[0]["metrics"]["loss:sum"]  # the same datum, three steps of Adam


def test_another_tenant_and_bad_paging_are_refused(stack, trained):
    stranger = _get(stack, trained, key=OTHER_API_KEY)
    unknown = _get(stack, trained.rsplit(":", 1)[0] + ":999")
    assert stranger.status_code == unknown.status_code == 404
    assert stranger.json()["detail"].replace(trained, "X") == unknown.json()["detail"].replace(
        trained.rsplit(":", 1)[0] + ":999", "X"
    )
    for name, value in (("after", "x"), ("after", -2), ("limit", 0), ("limit", 5001), ("limit", "1e3")):
        r = _get(stack, trained, params={name: value})
        assert r.status_code == 400, (name, value, r.status_code, r.text)


def test_forward_and_sampling_the_runs_weights_are_recorded_too(stack, training, trained):
    training.forward([DATUM], "cross_entropy").result(timeout=300)
    sampler = training.save_weights_and_get_sampling_client().result(timeout=300)
    prompt = types.ModelInput.from_ints([10, 20])
    sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=3, seed=1)).result(
        timeout=300
    )
    new = [p for p in _all_points(stack, trained, limit=1000) if p["index"] >= 2 * N]
    assert [p["op"] for p in new] == ["forward", "sample"]
    forward, sample = new
    assert forward["step"] == N and math.isfinite(forward["metrics"]["loss:sum"])
    assert sample["seq_id"] is None and sample["step"] == N
    assert sample["metrics"]["num_samples"] == 2 and 2 <= sample["metrics"]["tokens_generated"] <= 6


def test_the_jax_workers_metrics_show_mfu_and_flops_after_a_step(stack, trained, jax_metrics_port):
    text = httpx.get(f"http://127.0.0.1:{jax_metrics_port}/metrics", timeout=60).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("tinkerflow_engine_mfu", (("kind", "forward_backward"),))] > 0
    assert samples[("tinkerflow_engine_flops_total", (("kind", "forward_backward"),))] > 0
    memory = [k for k in samples if k[0] == "tinkerflow_device_memory_in_use_bytes"]
    if jax.local_devices()[0].memory_stats():  # the worker runs on this machine's JAX backend
        assert memory and all(samples[k] > 0 for k in memory)
    else:  # JAX's CPU backend reports no memory_stats: no series rather than a made-up zero
        assert memory == []


def test_points_survive_an_api_restart(stack, trained):
    before = _all_points(stack, trained, limit=1000)
    old = stack.kill_part("api")
    stack.wait_restarted("api", old)
    deadline_tries = 600
    for _ in range(deadline_tries):  # until the new API process answers (a bound on a hang, not a timing check)
        try:
            if _get(stack, trained).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    assert _all_points(stack, trained, limit=1000) == before
