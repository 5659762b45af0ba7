"""More training runs than LoRA adapter slots, through the unmodified SDK on the real stack (`tinkerflow up`).

A stack with `--max-lora-adapters 4` serves 40 runs of 3 tenants (three API keys): every create succeeds, every
run trains 3 rounds round-robin (forward_backward + optim_step on the same batch) and then samples its own weights,
with no error, and every run's loss falls. The runs' adapters are paged between the 4 device slots and host memory
(the worker's /metrics and the console show it). A tenant past --max-live-runs-per-tenant gets a clear user error
and another tenant is not affected."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import tinker
from tinker import types

from tinkerflow.cli.launch import free_port, launch

pytestmark = pytest.mark.e2e
KEYS = ["tml-paging-a", "tml-paging-b", "tml-paging-c"]
RUNS = 40
ROUNDS = 3
ADAM = types.AdamParams(learning_rate=5e-3)


def batch(n: int) -> list[types.Datum]:
    """A small batch of its own for each run (so no two runs learn the same thing)."""
    tokens = [10 + (n * 7 + i * 3) % 200 for i in range(9)]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs=dict(target_tokens=tokens[1:], weights=[1.0] * 8),  # pyright: ignore[reportArgumentType] (Datum converts lists)
        )
    ]


@pytest.fixture(scope="module")
def paged_stack(tmp_path_factory):
    metrics_port = free_port()
    stack = launch(
        tmp_path_factory.mktemp("paging") / "state",
        api_key=KEYS[0],
        extra=[
            *(arg for key in KEYS[1:] for arg in ("--api-key", key)),
            *("--max-lora-adapters", "4", "--max-live-runs-per-tenant", "16"),
            *("--metrics-port", str(metrics_port)),
        ],
    )
    stack.metrics_port = metrics_port  # pyright: ignore[reportAttributeAccessIssue] (test instrumentation)
    yield stack
    stack.stop()


def test_forty_runs_of_three_tenants_train_round_robin_on_four_slots_and_sample_their_own_weights(paged_stack):
    services = [tinker.ServiceClient(base_url=paged_stack.base_url, api_key=key) for key in KEYS]
    model = paged_stack.served_model()
    with ThreadPoolExecutor(max_workers=RUNS) as pool:
        runs = list(
            pool.map(
                lambda n: services[n % 3].create_lora_training_client(base_model=model, rank=4, seed=100 + n).result(),
                range(RUNS),
            )
        )
    assert len({r.model_id for r in runs}) == RUNS

    losses: list[list[float]] = [[] for _ in range(RUNS)]
    for _ in range(ROUNDS):
        steps = [(r.forward_backward(batch(n), "cross_entropy"), r.optim_step(ADAM)) for n, r in enumerate(runs)]
        for n, (fwd, opt) in enumerate(steps):
            losses[n].append(fwd.result(timeout=900).metrics["loss:sum"])
            opt.result(timeout=900)
    final = [r.forward_backward(batch(n), "cross_entropy") for n, r in enumerate(runs)]
    for n, fwd in enumerate(final):
        losses[n].append(fwd.result(timeout=900).metrics["loss:sum"])
    falling = [n for n in range(RUNS) if losses[n][-1] < losses[n][0]]
    assert falling == list(range(RUNS)), [losses[n] for n in range(RUNS) if n not in falling]

    # Each run samples its own weights: a sampler per run, all at once.
    samplers = [r.save_weights_and_get_sampling_client() for r in runs]
    samplers = [s.result() if hasattr(s, "result") else s for s in samplers]
    prompt = types.ModelInput.from_ints(batch(0)[0].model_input.to_ints()[:4])
    futures = [s.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=n)) for n, s in enumerate(samplers)]
    for f in futures:
        result = f.result(timeout=900)
        assert len(result.sequences) == 2 and all(len(seq.tokens) == 4 for seq in result.sequences)

    # The worker paged: 4 slots held 40 runs, and its /metrics says so.
    exposition = httpx.get(f"http://127.0.0.1:{paged_stack.metrics_port}/metrics", timeout=10).text
    assert _value(exposition, "tinkerflow_adapter_slots_used") <= 4
    assert _value(exposition, "tinkerflow_adapter_runs_paged") >= RUNS - 4
    assert _value(exposition, 'tinkerflow_adapter_page_moves_total{direction="in"}') >= RUNS
    assert _value(exposition, "tinkerflow_adapter_page_failures_total") == 0
    # ... and so does the console's service panel: slots, runs live, page-ins per second, page-in latency.
    http = httpx.Client(base_url=paged_stack.base_url, headers={"X-API-Key": KEYS[0]}, timeout=30)
    (served,) = http.get("/api/v1/console/service").json()["models"]
    assert (served["slots_used"], served["slots_total"], served["runs_live"]) == (4, 4, RUNS)
    assert served["runs_paged"] == RUNS - 4 and served["page_ins"] >= RUNS
    (engine,) = http.get("/api/v1/console/service").json()["engines"]
    assert engine["page_in_seconds_recent"] > 0 and engine["page_ins_per_second"] > 0


def test_a_tenant_past_its_live_run_limit_gets_a_user_error_and_another_tenant_does_not(paged_stack):
    """The first test left 14 live runs for tenant A (runs 0, 3, ..., 39) under a limit of 16."""
    a, b = (tinker.ServiceClient(base_url=paged_stack.base_url, api_key=key) for key in KEYS[:2])
    model = paged_stack.served_model()
    a.create_lora_training_client(base_model=model, rank=4).result(timeout=300)
    a.create_lora_training_client(base_model=model, rank=4).result(timeout=300)
    with pytest.raises(tinker.RequestFailedError, match=r"already holds 16 live training runs.*--max-live-runs"):
        a.create_lora_training_client(base_model=model, rank=4).result(timeout=300)
    b.create_lora_training_client(base_model=model, rank=4).result(timeout=300)  # tenant B holds 13: unaffected


def _value(exposition: str, series: str) -> float:
    """A series' value in a Prometheus exposition (summed over its labels when none are given)."""
    labels = "" if "{" in series else r"(?:\{[^}]*\})?"
    values = [float(m.group(1)) for m in re.finditer("^" + re.escape(series) + labels + r" (\S+)$", exposition, re.M)]
    assert values, f"{series} not in /metrics"
    return sum(values)
