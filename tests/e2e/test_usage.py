"""Metering end to end: a scripted workload through the unmodified SDK, then tinker's AdminClient reads back exactly
the tokens it used (prefill split by the prefix cache), the checkpoint it stored and the audit log of the day; a
tenant sees only its own, the operator key (--admin-api-key) everyone's."""

from __future__ import annotations

import time
from collections import Counter
from datetime import UTC, datetime, timedelta

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
