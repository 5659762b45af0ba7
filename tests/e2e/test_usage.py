"""Metering end to end: a scripted workload through the unmodified SDK, then tinker's AdminClient reads back exactly
the tokens it used (prefill split by the prefix cache), the checkpoint it stored and the audit log of the day; a
tenant sees only its own, the operator key (--admin-api-key) everyone's. A JAX worker killed with ops in flight
changes nothing in the counts: each op that completed is metered once, however often it ran."""

from __future__ import annotations

import time
from collections import Counter
from datetime import UTC, datetime, timedelta

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
# 66 tokens: four whole prefix-cache blocks, so the second call on the same sampler hits 64 of them
# (tests/e2e/test_sample_fields.py).
PROMPT = [5, 17, 42, 99, 3, 250, 7, 11, 60, 8, 19, 23, 71, 44, 2, 9, 31, 12, 88, 64, 101, 6] * 3
KEYS = {"alice": "tml-alice", "bob": "tml-bob", "operator": "tml-operator"}
FWDBWD_IN_FLIGHT = 6


def totals(usage: types.BillingUsageResponse) -> Counter[str]:
    out: Counter[str] = Counter()
    for event in usage.data:
        info = event.event_info
        if isinstance(info, types.SamplingPrefillBillingEvent):
            out["prefill_cached" if info.cached else "prefill"] += info.token_count
        elif isinstance(info, types.CheckpointBillingEvent):
            out["checkpoint"] += info.count
        elif isinstance(info, types.StorageBillingEvent):
            out["storage_gb_hours"] += info.gigabyte_hours > 0
        else:
            out[info.type] += info.token_count
    return out


def test_admin_client_answers_the_tokens_a_scripted_workload_used(tmp_path):
    extra = ["--api-key", KEYS["bob"], "--admin-api-key", KEYS["operator"]]
    stack = launch(tmp_path / "state", api_key=KEYS["alice"], extra=extra)
    try:
        model = stack.served_model()
        alice = tinker.ServiceClient(base_url=stack.base_url, api_key=KEYS["alice"])
        training = alice.create_lora_training_client(base_model=model, rank=4).result()
        for _ in range(2):
            training.forward_backward([DATUM], "cross_entropy").result(timeout=300)
        training.forward([DATUM], "cross_entropy").result(timeout=300)  # 3 x 3 training tokens
        saved = training.save_state("metered").result(timeout=300).path
        sampler = alice.create_sampling_client(base_model=model).result()
        params = types.SamplingParams(max_tokens=4, seed=2)
        first = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result(timeout=300)
        again = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result(timeout=300)
        assert (first.prompt_cache_hit_tokens, again.prompt_cache_hit_tokens) == (0, 64)
        sampled = sum(len(s.tokens) for r in (first, again) for s in r.sequences)

        bob = tinker.ServiceClient(base_url=stack.base_url, api_key=KEYS["bob"])
        bob.create_lora_training_client(base_model=model, rank=4).result().forward_backward(
            [DATUM], "cross_entropy"
        ).result(timeout=300)

        hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
        window = (hour - timedelta(hours=1), hour + timedelta(hours=2))
        admins = {who: tinker.AdminClient(base_url=stack.base_url, api_key=key) for who, key in KEYS.items()}
        want = {"training": 9, "prefill": 2 * 66 - 64, "prefill_cached": 64, "sampling_sample": sampled}
        deadline = time.monotonic() + 60  # a finished sample batch reaches Temporal's visibility within moments
        while True:
            usage = admins["alice"].get_billing_usage(*window).result()
            got = totals(usage)
            if all(got[k] == v for k, v in want.items()) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert {k: got[k] for k in want} == want
        assert got["checkpoint"] == 1 and got["storage_gb_hours"] >= 1
        alice_ids = {e.user_id for e in usage.data}
        assert len(alice_ids) == 1
        sessions = {e.session_id for e in usage.data}
        assert training.model_id.split(":")[0] in sessions and None not in sessions

        bob_usage = admins["bob"].get_billing_usage(*window).result()
        assert totals(bob_usage)["training"] == 3 and not alice_ids & {e.user_id for e in bob_usage.data}
        assert totals(admins["operator"].get_billing_usage(*window).result())["training"] == 12

        storage = admins["alice"].get_current_checkpoint_storage_usage().result()
        rest = tinker.RestClient(base_url=stack.base_url, api_key=KEYS["alice"])
        listed = rest.list_user_checkpoints().result().checkpoints
        assert [(i.checkpoint_count, i.size_bytes) for i in storage.data] == [(1, listed[0].size_bytes)]
        assert admins["bob"].get_current_checkpoint_storage_usage().result().data == []

        rest.delete_checkpoint_from_tinker_path(saved).result()
        log = admins["alice"].get_audit_log().result().entries
        events = [(e.event, e.event_details.get("object")) for e in log]
        for expected in [
            ("checkpoint_deleted", saved),
            ("run_created", training.model_id),
            ("session_created", training.model_id.split(":")[0]),
        ]:
            assert expected in events, events
        assert {e.event_details["key_id"] for e in log} == alice_ids
        assert not [e for e in admins["bob"].get_audit_log().result().entries if e.tinker_path == saved]
        only = admins["alice"].get_audit_log(event_type="checkpoints").result().entries
        assert only and {e.event.split("_")[0] for e in only} == {"checkpoint"}
    finally:
        stack.stop()


def _usage_when(admin: tinker.AdminClient, want: dict[str, int]) -> Counter[str]:
    """The caller's totals around this hour, once they equal `want` or after a minute (a finished sample batch
    reaches Temporal's visibility within moments)."""
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    deadline = time.monotonic() + 60
    while True:
        got = totals(admin.get_billing_usage(hour - timedelta(hours=1), hour + timedelta(hours=2)).result())
        if all(got[k] == v for k, v in want.items()) or time.monotonic() > deadline:
            return got
        time.sleep(1)


def _wait_busy(stack, timeout_s: float = 120) -> None:
    """Until the Coordinator has a batch on a JAX worker (its describe query, read as the console's service panel
    reads it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        service = httpx.get(
            f"{stack.base_url}/api/v1/console/service", headers={"X-API-Key": KEYS["alice"]}, timeout=30
        ).json()
        if any(w["busy"] for m in service["models"] if m["answered"] for w in m["workers"]):
            return
        time.sleep(0.02)
    raise AssertionError(f"no batch reached the JAX worker within {timeout_s} s")


def test_ops_in_flight_when_the_jax_worker_is_killed_are_metered_once(tmp_path):
    extra = ["--admin-api-key", KEYS["operator"], "--restart-backoff-s", "0.5"]
    stack = launch(tmp_path / "state", api_key=KEYS["alice"], extra=extra)
    try:
        model = stack.served_model()
        alice = tinker.ServiceClient(base_url=stack.base_url, api_key=KEYS["alice"])
        training = alice.create_lora_training_client(base_model=model, rank=4).result()
        sampler = alice.create_sampling_client(base_model=model).result()
        params = types.SamplingParams(max_tokens=16, seed=2)
        prompt = types.ModelInput.from_ints(PROMPT)
        adam = types.AdamParams(learning_rate=1e-3)
        # One of each first, so the kill lands on work rather than on the first compiles.
        done = [sampler.sample(prompt, 1, params)]
        training.forward_backward([DATUM], "cross_entropy").result(timeout=300)
        training.optim_step(adam).result(timeout=300)
        done[0].result(timeout=300)
        before = stack.parts()["jax-worker"]["restarts"]

        fwdbwd = [training.forward_backward([DATUM], "cross_entropy") for _ in range(FWDBWD_IN_FLIGHT)]
        optim = training.optim_step(adam)
        in_flight = [sampler.sample(prompt, 2, params) for _ in range(2)]
        _wait_busy(stack)  # a batch is on the worker: the kill lands mid-batch, not between ops
        old = stack.kill_part("jax-worker")
        stack.wait_restarted("jax-worker", old)
        for f in fwdbwd:
            assert f.result(timeout=900).metrics["loss:sum"] > 0
        optim.result(timeout=900)
        samples = [done[0].result(), *(f.result(timeout=900) for f in in_flight)]
        assert stack.parts()["jax-worker"]["restarts"] == before + 1
        run = httpx.get(
            f"{stack.base_url}/api/v1/console/runs/{training.model_id}", headers={"X-API-Key": KEYS["alice"]}
        ).json()
        assert run["recoveries"] >= 1  # an op came back worker-lost and ran again on the restarted worker

        # Exactly the work that completed: each forward_backward of 3 tokens once; each sample call's prompt once,
        # split by what the prefix cache served it (a cache the restart emptied serves less), and its tokens.
        cached = sum(s.prompt_cache_hit_tokens or 0 for s in samples)
        want = {
            "training": (1 + FWDBWD_IN_FLIGHT) * 3,
            "prefill": len(samples) * len(PROMPT) - cached,
            "prefill_cached": cached,
            "sampling_sample": sum(len(seq.tokens) for s in samples for seq in s.sequences),
        }
        got = _usage_when(tinker.AdminClient(base_url=stack.base_url, api_key=KEYS["alice"]), want)
        assert {k: got[k] for k in want} == want
    except Exception:
        print(stack.logs())
        raise
    finally:
        stack.stop()
