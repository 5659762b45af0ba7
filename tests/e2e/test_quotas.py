"""Quotas end to end, through the unmodified SDK on a real stack with a quota file: a key past its daily training
tokens gets its op's future failed as a user error naming the quota, its samples past the per-minute limit are
retried by the SDK until the window turns, another key is unaffected throughout, a bad file sent by SIGHUP changes
nothing and a raised quota sent by SIGHUP (to `up`, which passes it to the API) lets the first key through; /metrics
counts it all per tenant."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from datetime import UTC, datetime

import httpx
import pytest
import tinker
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from tinkerflow.cli.launch import RunningStack, launch
from tinkerflow.common.tenancy import key_id

pytestmark = pytest.mark.e2e
ALICE, BOB = "tml-quota-alice", "tml-quota-bob"
SIGNING_KEY = "e2e-quota-signing-key"  # given, so the test knows each key's id (the /metrics tenant label)
TENANT = {key: key_id(SIGNING_KEY.encode(), key) for key in (ALICE, BOB)}
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([10, 20, 30]),  # 3 training tokens
    loss_fn_inputs=dict(target_tokens=[20, 30, 40], weights=[1.0, 1.0, 1.0]),  # pyright: ignore[reportArgumentType] (Datum converts lists)
)
PROMPT, PARAMS = types.ModelInput.from_ints([5, 17, 42]), types.SamplingParams(max_tokens=4, seed=3)  # reserves 7


def quota_file(training_tokens_per_day: int) -> str:
    return f'[keys."{ALICE}"]\ntraining_tokens_per_day = {training_tokens_per_day}\nsampling_tokens_per_minute = 10\n'


def metrics(stack: RunningStack) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{stack.base_url}/metrics", headers={"X-API-Key": BOB}, timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(stack: RunningStack, name: str, **labels: str) -> float:
    return metrics(stack).get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(what: str, ok: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.5)


def sighup(stack: RunningStack, path, text: str, result: str, *, to_up: bool = False) -> None:
    """Write the quota file, SIGHUP the API process (or `up`, which passes it on), and wait until the API says it
    read it (or refused it)."""
    before = value(stack, "tinkerflow_quota_reloads_total", result=result)
    path.write_text(text)
    os.kill(stack.proc.pid if to_up else stack.parts()["api"]["pid"], signal.SIGHUP)
    wait_for(
        f"a SIGHUP reload ({result})", lambda: value(stack, "tinkerflow_quota_reloads_total", result=result) > before
    )


def test_quotas_refuse_one_key_only_and_a_sighup_raise_lets_it_through(tmp_path):
    quotas = tmp_path / "quotas.toml"
    quotas.write_text(quota_file(5))
    extra = ["--api-key", BOB, "--quota-file", str(quotas), "--ledger-read-s", "1", "--url-signing-key", SIGNING_KEY]
    stack = launch(tmp_path / "state", api_key=ALICE, extra=extra)
    try:
        model = stack.served_model()
        alice = tinker.ServiceClient(base_url=stack.base_url, api_key=ALICE)
        bob = tinker.ServiceClient(base_url=stack.base_url, api_key=BOB)
        trained = alice.create_lora_training_client(base_model=model, rank=4).result()
        trained.forward_backward([DATUM], "cross_entropy").result(timeout=300)  # 3 of 5 tokens today
        with pytest.raises(tinker.RequestFailedError, match="training_tokens_per_day quota") as refused:
            trained.forward_backward([DATUM], "cross_entropy").result(timeout=300)
        assert str(refused.value.category).lower().endswith("user")
        assert "may train 5 tokens a UTC day and has used 3 today" in str(refused.value)
        other = bob.create_lora_training_client(base_model=model, rank=4).result()
        for _ in range(2):
            other.forward_backward([DATUM], "cross_entropy").result(timeout=300)

        # Two calls of 7 tokens in one minute's window of 10: the second gets 429 and the SDK retries it (every
        # second, in its own thread) until the next window, while the rest of the test goes on.
        if datetime.now(UTC).second >= 50:
            time.sleep(61 - datetime.now(UTC).second)
        sampler = alice.create_sampling_client(base_model=model).result()
        limited = [sampler.sample(PROMPT, 1, PARAMS) for _ in range(2)]
        bob_sampler = bob.create_sampling_client(base_model=model).result()
        assert all(r.sequences for r in [bob_sampler.sample(PROMPT, 1, PARAMS).result(timeout=120) for _ in range(2)])

        sighup(stack, quotas, "[keys\n", "error")  # refused: the old quotas stay
        with pytest.raises(tinker.RequestFailedError, match="training_tokens_per_day quota"):
            trained.forward_backward([DATUM], "cross_entropy").result(timeout=300)
        api = stack.parts()["api"]["pid"]
        sighup(stack, quotas, quota_file(1000), "ok", to_up=True)  # one signal to `up` reloads, and stops nothing
        trained.forward_backward([DATUM], "cross_entropy").result(timeout=300)
        assert stack.proc.poll() is None and stack.parts()["api"]["pid"] == api  # nothing stopped or restarted
        assert f"SIGHUP passed to the API (pid {api})" in (stack.state_dir / "up.log").read_text()

        assert all(r.sequences for r in [f.result(timeout=150) for f in limited])
        a, b = {"tenant": TENANT[ALICE]}, {"tenant": TENANT[BOB]}
        refusals = "tinkerflow_tenant_quota_refusals_total"
        assert value(stack, refusals, **a, quota="training_tokens_per_day") == 2
        assert value(stack, refusals, **a, quota="sampling_tokens_per_minute") >= 1
        assert not [k for k in metrics(stack) if k[0] == refusals and ("tenant", TENANT[BOB]) in k[1]]
        training = "tinkerflow_tenant_training_tokens_total"
        wait_for("the ledgers' training tokens on /metrics", lambda: value(stack, training, **a) == 6)  # 2 of 4 ops
        assert value(stack, training, **b) == 6
        for who in (a, b):  # two calls each, their 3-token prompt counted once per call
            wait_for("the sample batches on /metrics", lambda who=who: _prompts(stack, who) == 6)
            assert 0 < value(stack, "tinkerflow_tenant_sampled_tokens_total", **who) <= 8
    finally:
        stack.stop()


def _prompts(stack: RunningStack, who: dict[str, str]) -> float:
    name = "tinkerflow_tenant_sampling_prompt_tokens_total"
    return sum(value(stack, name, **who, cached=c) for c in ("true", "false"))
