"""Several JAX workers serving one base model, and what an operator scrapes from them."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest
import tinker
from temporalio.client import Client
from tinker import types

from tinkerflow.cli.launch import free_port
from tinkerflow.cli.up import Stack
from tinkerflow.common.settings import Settings

pytestmark = pytest.mark.e2e
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([10, 20, 30, 40]),
    loss_fn_inputs=dict(target_tokens=[20, 30, 40, 50], weights=[1.0, 1.0, 1.0, 1.0]),  # pyright: ignore[reportArgumentType] (Datum converts lists)
)


def test_two_workers_share_the_runs_expose_metrics_and_take_over_a_dead_ones_runs(tmp_path):
    temporal_port, metrics_1, metrics_2 = free_port(), free_port(), free_port()
    settings = Settings(
        state_dir=tmp_path / "state",
        port=free_port(),
        api_keys=("tml-pool",),
        temporal_address=f"127.0.0.1:{temporal_port}",
        max_lora_adapters=2,
    )
    stack = Stack(settings)
    try:
        stack.start_temporal(temporal_port, 0, headless=True)
        stack.start_worker("workflow-worker")
        stack.start_worker("jax-worker", "--worker-id", "w1", "--metrics-port", str(metrics_1), name="jax-worker-1")
        stack.start_worker("jax-worker", "--worker-id", "w2", "--metrics-port", str(metrics_2), name="jax-worker-2")
        stack.start_api()
        service = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
        model = stack.served_model()
        runs = [service.create_lora_training_client(base_model=model, rank=4).result() for _ in range(2)]
        for run in runs:
            run.forward_backward([DATUM], "cross_entropy").result(timeout=300)
            run.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=300)

        async def placement() -> dict:
            client = await Client.connect(settings.temporal_address)
            return await client.get_workflow_handle(f"coordinator/{model}/default").query("describe")

        described = asyncio.run(placement())
        # least loaded first: one run on each worker
        assert sorted(w["slots_used"] for w in described["workers"].values()) == [1, 1]
        assert {q for q, _slot in described["placements"].values()} == set(described["workers"])

        worker_metrics = "\n".join(httpx.get(f"http://127.0.0.1:{p}/metrics").text for p in (metrics_1, metrics_2))
        for series in (
            'tinkerflow_engine_op_seconds_bucket{kind="forward_backward"',
            "tinkerflow_engine_batch_items_bucket",
            'tinkerflow_engine_tokens_total{kind="forward_backward"}',
            "tinkerflow_engine_tokens_per_second",
            "tinkerflow_adapter_slots_used 1.0",
            "tinkerflow_adapter_slots_total 2.0",
        ):
            assert series in worker_metrics, series
        # /metrics of the API answers API keys (by default; --metrics-access), e.g. as a Prometheus bearer token.
        api_metrics = httpx.get(f"{stack.base_url}/metrics", headers={"Authorization": f"Bearer {stack.api_key}"}).text
        assert 'tinkerflow_api_request_seconds_bucket{le="0.005",route="/api/v1/forward_backward"}' in api_metrics
        assert 'tinkerflow_api_requests_total{route="/api/v1/optim_step",status="200"}' in api_metrics

        # kill -9 the worker holding runs[0], for good: its heartbeats stop, the coordinator drops it, and the run
        # restores its adapter on the survivor (seeded re-creation + the logged step) and answers its futures.
        queue, _slot = described["placements"][runs[0].model_id]
        victim = {"w1": "jax-worker-1", "w2": "jax-worker-2"}[described["workers"][queue]["worker_id"]]
        before = runs[0].forward([DATUM], "cross_entropy").result(timeout=300).metrics["loss:sum"]
        pending = runs[0].forward_backward([DATUM], "cross_entropy")
        killed_at = time.monotonic()
        stack.kill(victim)
        after = pending.result(timeout=600).metrics["loss:sum"]
        print(f"\nworker killed -> its run answered again on the survivor in {time.monotonic() - killed_at:.1f} s")
        np.testing.assert_allclose(after, before, rtol=1e-5)  # the restored adapter is the one that was lost
        runs[0].optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=300)
        survivors = asyncio.run(placement())
        assert list(survivors["workers"]) == [q for q in described["workers"] if q != queue]
        assert survivors["placements"][runs[0].model_id][0] != queue
    finally:
        stack.stop()
