"""The quota refusals through the real routes, up to where a request would reach Temporal (stood in for here; the
e2e test has the stack): what each kind of refusal looks like to a client, and that the other key is unaffected."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from tinkerflow.api import (
    endpoint_sampling,
    request_ids,
    routes_anthropic,
    routes_futures,
    routes_sampling,
    routes_training,
)
from tinkerflow.api.openai_models import OpenAIError
from tinkerflow.api.quota_checks import Quotas, Refusal
from tinkerflow.common.checkpoints import Manifest
from tinkerflow.common.quotas import parse
from tinkerflow.common.settings import Settings
from tinkerflow.common.store import ClaimCheckStore
from tinkerflow.workflows.protocol.messages import ModelCard, OpKind, SamplerInfo

KEYS = {"tml-alice": "a" * 16, "tml-bob": "b" * 16}  # API key -> key id
ALICE, BOB = KEYS
QUOTAS = """\
[keys."tml-alice"]
training_tokens_per_day = 10
sampling_tokens_per_minute = 10
sampling_tokens_per_day = 20
concurrent_runs = 1
stored_gb = 0.000001
"""
NOON = datetime(2026, 7, 13, 12, 0, 30, tzinfo=UTC)
SIGNING_KEY = b"server-key"


class _Temporal:
    """Records what the routes hand to Temporal; answers the live-run listing of the concurrent_runs check."""

    def __init__(self) -> None:
        self.ops: list[tuple[str, Any]] = []
        self.created: list[str] = []
        self.live: dict[str, str] = {}  # run workflow id -> owner
        self.unreachable = 0  # the next n updates fail as a connection to Temporal would

    def get_workflow_handle(self, workflow_id: str, run_id: str | None = None):
        temporal = self

        class Handle:
            async def start_update(self, _update, op, id: str, wait_for_stage):
                if temporal.unreachable:
                    temporal.unreachable -= 1
                    raise RuntimeError("connection refused")
                temporal.ops.append((workflow_id, op))
                return SimpleNamespace(workflow_id=workflow_id, workflow_run_id="r", id=id, _known_outcome=None)

        return Handle()

    def list_workflows(self, query: str):
        async def listing():
            for wf, owner in self.live.items():
                if f"'{owner}'" in query:
                    yield SimpleNamespace(id=wf)

        return listing()

    async def start_update_with_start_workflow(self, _update, *, start_workflow_operation, id, wait_for_stage):
        self.created.append(id)
        return SimpleNamespace(workflow_id="training-run/x", workflow_run_id="r", id=id)


class _Batcher:
    def __init__(self) -> None:
        self.calls = 0

    async def submit(self, sampler: SamplerInfo, payload, *, samples: int = 1, work: int = 0) -> tuple[str, int]:
        self.calls += 1
        return f"sample/{sampler.sampler_id}/{self.calls}", 0


class _Models:
    async def get(self, name: str):
        return ModelCard(name, "qwen3", "", 1000, 64)


async def _no_queue(coordinator: str) -> tuple[int, int]:
    return 0, 0


@pytest.fixture
def stack(tmp_path) -> SimpleNamespace:
    app, stored = FastAPI(), []
    for module in (routes_sampling, routes_training, routes_futures):
        app.include_router(module.router)
    samplers = {
        f"s{n}:sample:0": SamplerInfo(f"s{n}:sample:0", "tiny", owner=owner) for n, owner in enumerate(KEYS.values())
    }
    svc = SimpleNamespace(
        settings=Settings(state_dir=tmp_path, long_poll_s=1.0),
        api_keys=tuple(KEYS),
        owner_of=KEYS.get,
        signing_key=SIGNING_KEY,
        quotas=Quotas(parse(QUOTAS, "q.toml"), KEYS.__getitem__, tuple(KEYS), now=lambda: NOON),
        client=_Temporal(),
        samplers=samplers,
        queued_samples=_no_queue,
        queue_depths=SimpleNamespace(admitted=lambda *args: None),
        store=ClaimCheckStore(tmp_path.as_uri()),
        sample_batcher=_Batcher(),
        registry=_Models(),
        checkpoints=SimpleNamespace(list=lambda: list(stored)),  # the checkpoints the stood-in store lists
    )
    app.state.services = svc
    http = TestClient(app, raise_server_exceptions=False)
    return SimpleNamespace(http=http, svc=svc, samplers=list(samplers), stored=stored)


def _sample(stack: SimpleNamespace, key: str, max_tokens: int = 4):
    sampler = stack.samplers[list(KEYS).index(key)]
    body = {
        "sampling_session_id": sampler,
        "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},  # 3 + 1 x 4 = 7 tokens reserved
        "sampling_params": {"max_tokens": max_tokens},
    }
    return stack.http.post("/api/v1/asample", json=body, headers={"X-API-Key": key})


def _refusals(owner: str, quota: str) -> float:
    return REGISTRY.get_sample_value("tinkerflow_tenant_quota_refusals_total", {"tenant": owner, "quota": quota}) or 0


def test_a_sample_past_the_rate_limit_is_a_429_until_the_windows_end_and_the_other_key_samples_on(stack):
    before = _refusals(KEYS[ALICE], "sampling_tokens_per_minute")
    assert _sample(stack, ALICE).status_code == 200
    limited = _sample(stack, ALICE)
    assert limited.status_code == 429 and limited.headers["Retry-After"] == "30"
    assert "sampling_tokens_per_minute quota" in limited.json()["detail"]
    assert "may reserve 10 sampling tokens a minute and has reserved 7" in limited.json()["detail"]
    assert [_sample(stack, BOB).status_code for _ in range(3)] == [200, 200, 200]
    assert _refusals(KEYS[ALICE], "sampling_tokens_per_minute") == before + 1
    assert _refusals(KEYS[BOB], "sampling_tokens_per_minute") == 0
    assert _sample(stack, ALICE, max_tokens=100).status_code == 400  # more than a whole minute's: never passes


def test_a_sample_past_the_daily_quota_fails_its_future_as_a_user_error_naming_the_quota(stack):
    minutes = iter(range(10))
    stack.svc.quotas._now = lambda: NOON.replace(minute=next(minutes))  # pyright: ignore[reportPrivateUsage] (each call a new window)
    assert [_sample(stack, ALICE).status_code for _ in range(2)] == [200, 200]  # 14 of 20 today
    over = _sample(stack, ALICE)
    assert over.status_code == 200  # not a 429: the SDK would retry it every second until midnight
    ref = request_ids.decode(over.json()["request_id"], SIGNING_KEY, KEYS[ALICE])
    assert isinstance(ref, request_ids.FailedRef) and ref.category == "user"
    future = stack.http.post(
        "/api/v1/retrieve_future", json={"request_id": over.json()["request_id"]}, headers={"X-API-Key": ALICE}
    )
    assert future.json()["category"] == "user" and "sampling_tokens_per_day quota" in future.json()["error"]
    assert stack.svc.sample_batcher.calls == 2


def _forward_backward(stack: SimpleNamespace, key: str, seq_id: int, tokens: int):
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(tokens))),
        loss_fn_inputs={"target_tokens": list(range(tokens)), "weights": [1.0] * tokens},  # pyright: ignore[reportArgumentType] (Datum converts lists)
    )
    inp = types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy")
    req = types.ForwardBackwardRequest(forward_backward_input=inp, model_id=f"{key[4:]}:train:0", seq_id=seq_id)
    body = forward_backward_request_to_proto(req).SerializeToString()
    headers = {"X-API-Key": key, "Content-Type": "application/x-protobuf"}
    return stack.http.post("/api/v1/forward_backward", content=body, headers=headers)


def test_a_training_op_past_the_daily_quota_takes_its_seq_id_and_fails_as_a_user_error(stack):
    answers = [_forward_backward(stack, ALICE, 1, 6), _forward_backward(stack, ALICE, 2, 6)]
    answers += [_forward_backward(stack, BOB, 1, 6), _forward_backward(stack, BOB, 2, 6)]
    assert [a.status_code for a in answers] == [200] * 4  # never refused at submit
    kinds = [(wf, op.seq_id, op.kind) for wf, op in stack.svc.client.ops]
    assert kinds == [
        ("training-run/alice:train:0", 1, OpKind.FORWARD_BACKWARD),
        ("training-run/alice:train:0", 2, OpKind.REJECT),  # 6 + 6 > 10
        ("training-run/bob:train:0", 1, OpKind.FORWARD_BACKWARD),
        ("training-run/bob:train:0", 2, OpKind.FORWARD_BACKWARD),
    ]
    error = stack.svc.client.ops[1][1].error
    assert error.startswith("forward_backward: training_tokens_per_day quota: this API key may train 10 tokens")
    assert "has used 6 today; this op's datums hold 6 more" in error


def test_an_sdk_resend_of_a_training_op_is_charged_once(stack):
    # The SDK sends a request again, same seq_id and body, after a connection error: Temporal answers the resend with
    # the first update and the run meters the op once, so the quota charges it once too.
    first, resent = _forward_backward(stack, ALICE, 1, 6), _forward_backward(stack, ALICE, 1, 6)
    assert first.status_code == resent.status_code == 200
    day = NOON.date().isoformat()
    assert stack.svc.quotas.tally.training(KEYS[ALICE], day) == 6
    assert _forward_backward(stack, ALICE, 2, 4).status_code == 200  # 6 + 4 fits in 10; 6 + 6 + 4 would not
    ops = [(op.seq_id, op.kind, op.body_hash) for _, op in stack.svc.client.ops]
    assert [o[:2] for o in ops] == [(1, OpKind.FORWARD_BACKWARD)] * 2 + [(2, OpKind.FORWARD_BACKWARD)]
    assert ops[0] == ops[1]  # one update id: the resend resolves to the first answer
    assert stack.svc.quotas.tally.training(KEYS[ALICE], day) == 10


def test_a_training_op_never_accepted_is_charged_when_it_is_sent_again(stack):
    stack.svc.client.unreachable = 1
    assert _forward_backward(stack, ALICE, 1, 6).status_code == 503  # never reached its run: refunded
    day = NOON.date().isoformat()
    assert stack.svc.quotas.tally.training(KEYS[ALICE], day) == 0
    assert _forward_backward(stack, ALICE, 1, 6).status_code == 200
    assert stack.svc.quotas.tally.training(KEYS[ALICE], day) == 6
    assert [op.kind for _, op in stack.svc.client.ops] == [OpKind.FORWARD_BACKWARD]


def test_a_create_past_concurrent_runs_is_a_429_and_the_other_key_creates(stack, monkeypatch):
    async def session_of_caller(svc, session_id, who):
        return None

    monkeypatch.setattr(routes_training, "session_of_caller", session_of_caller)
    stack.svc.client.live["training-run/alice:train:0"] = KEYS[ALICE]
    body = {"session_id": "alice", "model_seq_id": 1, "base_model": "tiny", "lora_config": {"rank": 4}}
    refused = stack.http.post("/api/v1/create_model", json=body, headers={"X-API-Key": ALICE})
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "30"
    assert "concurrent_runs quota: this API key may hold 1 live training runs and holds 1" in refused.json()["detail"]
    created = stack.http.post("/api/v1/create_model", json={**body, "session_id": "bob"}, headers={"X-API-Key": BOB})
    assert created.status_code == 200 and stack.svc.client.created == ["create"]


def test_the_openai_and_anthropic_endpoints_answer_a_quota_429_with_its_retry_after(monkeypatch):
    async def refused(*args):
        return Refusal("sampling_tokens_per_day", "sampling_tokens_per_day quota: used up", 4321)

    class Samplers:
        async def sampler(self, *args):
            return SamplerInfo("s:sample:0", "tiny")

    monkeypatch.setattr(endpoint_sampling, "submit_sample", refused)
    target = endpoint_sampling.Target(ModelCard("tiny", "qwen3", "", 1000, 64), "")
    knobs = SimpleNamespace(n=1, temperature=1.0, top_p=1.0, top_k=-1, seed=None, stop=None)
    with pytest.raises(OpenAIError) as e:
        asyncio.run(endpoint_sampling.submit(SimpleNamespace(), Samplers(), "o", target, [1], knobs, 4))  # pyright: ignore[reportArgumentType] (stand-ins)
    assert (e.value.status, e.value.code, e.value.retry_after_s) == (429, "insufficient_quota", 4321)
    answer = routes_anthropic._error_response(routes_anthropic.as_anthropic(e.value))  # pyright: ignore[reportPrivateUsage]
    assert answer.status_code == 429 and answer.headers["Retry-After"] == "4321"


def test_a_named_save_once_the_key_stores_its_stored_gb_fails_as_a_user_error(stack):
    def manifest(owner: str, run: str) -> Manifest:
        return Manifest(f"tinker://{run}:train:0/weights/a", owner, "tiny", {}, "2026-07-13T00:00:00Z", size_bytes=1000)

    stack.stored[:] = [manifest(KEYS[ALICE], "alice"), manifest(KEYS[BOB], "bob")]  # 1,000 bytes each: alice's limit
    for key in (ALICE, BOB):
        run = {"model_id": f"{key[4:]}:train:0", "seq_id": 1}
        assert stack.http.post("/api/v1/save_weights", json={**run, "path": "b"}, headers={"X-API-Key": key}).is_success
        sampler = {**run, "seq_id": 2, "sampling_session_seq_id": 0}  # an in-memory snapshot: nothing stored
        assert stack.http.post("/api/v1/save_weights_for_sampler", json=sampler, headers={"X-API-Key": key}).is_success
    kinds = [(wf.split("/")[1][:3], op.kind) for wf, op in stack.svc.client.ops]
    assert kinds == [
        ("ali", OpKind.REJECT),
        ("ali", OpKind.SAVE_WEIGHTS_FOR_SAMPLER),
        ("bob", OpKind.SAVE_WEIGHTS),  # no stored_gb of its own
        ("bob", OpKind.SAVE_WEIGHTS_FOR_SAMPLER),
    ]
    error = stack.svc.client.ops[0][1].error
    assert error.startswith("save_weights: stored_gb quota: this API key may store 1e-06 GB of checkpoints and stores")
