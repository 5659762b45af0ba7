"""`GET /api/v1/training_runs/{id}/metrics` without a stack: the whole app (create_app) over a stand-in Temporal
client whose one run belongs to alice. Tenancy (404 alike for a stranger and an unknown run), paging, and hostile
`after`/`limit` values: a 400 naming the parameter, never a 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from temporalio.service import RPCError, RPCStatusCode

from tinkerflow.api.app import create_app
from tinkerflow.common.run_metrics import RunMetricsStore
from tinkerflow.common.settings import Settings
from tinkerflow.workflows.protocol.messages import LoraSpec, RunStart, RunState

ALICE, BOB = "tml-alice", "tml-bob"
RUN = "sess-1:train:0"
POINTS = 7


class _Handle:
    def __init__(self, state: RunState | None):
        self.state = state

    async def query(self, *_: Any, **__: Any) -> RunState:
        if self.state is None:
            raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
        return self.state


class _Temporal:
    """Answers `describe` for the one run; every other workflow does not exist."""

    def __init__(self) -> None:
        self.run: RunState | None = None

    def own(self, owner: str) -> None:
        start = RunStart(model_id=RUN, session_id="sess-1", owner=owner, base_model="m", lora=LoraSpec(rank=4))
        self.run = RunState(start=start)

    def get_workflow_handle(self, workflow_id: str, **_: Any) -> _Handle:
        return _Handle(self.run if workflow_id == f"training-run/{RUN}" else None)


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[TestClient]:
    state = tmp_path_factory.mktemp("state")
    s = Settings(state_dir=state, api_keys=(ALICE, BOB))
    store = RunMetricsStore(s.resolved_store_url)
    for seq in range(POINTS):
        store.record(RUN, "forward_backward", f"seq:{seq}", {"loss:sum": float(seq)}, seq_id=seq, step=seq)
    temporal = _Temporal()
    app = create_app(s, client=temporal)  # pyright: ignore[reportArgumentType] (a stand-in for the few calls made)
    with TestClient(app, raise_server_exceptions=False) as client:
        temporal.own(app.state.services.owner_of(ALICE))  # the owner id is keyed with the server's signing key
        yield client


def _get(api: TestClient, run: str, key: str, **params: Any):
    return api.get(f"/api/v1/training_runs/{run}/metrics", params=params, headers={"X-API-Key": key})


def test_the_owner_pages_through_every_point(api):
    seen, after = [], -1
    while after is not None:
        body = _get(api, RUN, ALICE, after=after, limit=3).json()
        assert body["training_run_id"] == RUN and body["total_points"] == POINTS
        seen += body["points"]
        after = body["next_after"]
    assert [p["index"] for p in seen] == list(range(POINTS))
    assert seen[2] == {
        "index": 2,
        "op": "forward_backward",
        "seq_id": 2,
        "step": 2,
        "time": seen[2]["time"],
        "metrics": {"loss:sum": 2.0},
    }


def test_a_stranger_gets_the_answer_of_a_run_that_does_not_exist(api):
    stranger, unknown = _get(api, RUN, BOB), _get(api, "sess-1:train:9", ALICE)
    assert stranger.status_code == unknown.status_code == 404
    assert stranger.json()["detail"].replace(RUN, "?") == unknown.json()["detail"].replace("sess-1:train:9", "?")
    assert _get(api, RUN, "tml-nobody").status_code == 401


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    after=st.none() | st.integers(-(2**70), 2**70).map(str) | st.text(max_size=12),
    limit=st.none() | st.integers(-(2**70), 2**70).map(str) | st.text(max_size=12),
)
def test_hostile_paging_parameters_are_400_never_5xx(api, after, limit):
    params = {k: v for k, v in (("after", after), ("limit", limit)) if v is not None}
    r = _get(api, RUN, ALICE, **params)
    assert r.status_code in (200, 400), (params, r.status_code, r.text)
    if r.status_code == 400:
        assert any(name in r.json()["detail"] for name in params), r.text
