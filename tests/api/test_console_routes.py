"""The console's pages and assets without a browser (the browser test is tests/e2e/test_console.py): pages hold no
data and carry a strict CSP; plotly.js comes from the installed wheel; the console's data routes want a key."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from temporalio.client import Client

from tinkerflow.api import console_data, console_status
from tinkerflow.api.app import create_app
from tinkerflow.api.worker_metrics import WorkerMetrics, summarize, worker_metrics_urls
from tinkerflow.cli.launch import free_port
from tinkerflow.common.settings import Settings
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import LoraSpec, RunStart, RunState

KEY = "tml-console"


@pytest.fixture
def http(tmp_path):
    address = f"127.0.0.1:{free_port()}"  # nothing listens: the pages must not need Temporal
    settings = Settings(state_dir=tmp_path, temporal_address=address, api_keys=(KEY,))
    client = asyncio.run(Client.connect(address, lazy=True))
    with TestClient(create_app(settings, client=client), raise_server_exceptions=False) as c:
        yield c


@pytest.mark.parametrize("path", ["/console/", "/console/runs/sess-abc:train:0", "/console/usage"])
def test_pages_are_static_with_a_strict_policy(http, path):
    r = http.get(path)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["referrer-policy"] == "no-referrer"
    assert "<script>" not in r.text  # nothing inline: the policy would refuse it anyway
    assert 'id="login"' in r.text


def test_console_without_slash_redirects(http):
    r = http.get("/console", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "/console/"


def test_assets_come_from_the_package_and_nothing_else_is_served(http):
    js = http.get("/console/static/plotly.min.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert len(js.content) > 1_000_000 and b"plotly" in js.content[:2000].lower()
    for name in ["common.js", "runs.js", "run.js", "usage.js"]:
        assert http.get(f"/console/static/{name}").headers["content-type"].startswith("text/javascript"), name
    assert http.get("/console/static/console.css").headers["content-type"].startswith("text/css")
    for name in ["../app.py", "..%2Fapp.py", "index.html", "nope.js"]:
        assert http.get(f"/console/static/{name}").status_code == 404, name


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/console/runs",
        "/api/v1/console/sessions",
        "/api/v1/console/service",
        "/api/v1/console/runs/x",
        "/api/v1/console/usage",
    ],
)
def test_console_data_wants_a_key(http, path):
    assert http.get(path).status_code == 401
    assert http.get(path, headers={"X-API-Key": "tml-wrong"}).status_code == 401
    # With the key it reaches Temporal (down here): 503 naming it, not a page of someone's runs.
    r = http.get(path, headers={"X-API-Key": KEY})
    assert r.status_code in (400, 503), r.text  # "x" is not a model id shape: 400 before Temporal is asked


def test_usage_names_its_bad_fields_and_keeps_a_tenant_to_its_own(http):
    def usage(**params):
        return http.get("/api/v1/console/usage", params=params, headers={"X-API-Key": KEY})

    for params, field in [({"days": 15}, "days"), ({"days": 0}, "days"), ({"tenant": "a" * 17}, "tenant")]:
        r = usage(**params)
        assert r.status_code == 400 and field in r.json()["detail"], (params, r.text)
    r = usage(tenant="' OR '1'='1")  # it would become visibility-query text: refused by shape
    assert r.status_code == 400 and "is not an owner id" in r.json()["detail"]
    r = usage(tenant="0123456789abcdef")  # another tenant's id, from a tenant's key
    assert r.status_code == 403 and "only the operator's key" in r.json()["detail"]


def test_search_text_is_bounded(http):
    r = http.get("/api/v1/console/runs", params={"q": "a" * 201}, headers={"X-API-Key": KEY})
    assert r.status_code == 400


def test_temporal_ui_url_is_derived_as_up_prints_it(tmp_path):
    s = Settings(state_dir=tmp_path, temporal_address="10.1.2.3:7233", ui_port=8444)
    assert s.resolved_temporal_ui_url == "http://10.1.2.3:8444"
    given = Settings(state_dir=tmp_path, temporal_ui_url="https://temporal.example/")
    assert given.resolved_temporal_ui_url == "https://temporal.example"


def test_worker_exposition_is_summarized_for_the_service_panel(tmp_path):
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    reg = CollectorRegistry()
    tps = Gauge("tinkerflow_engine_tokens_per_second", "t", ["kind"], registry=reg)
    tps.labels("forward_backward").set(1234.5)
    tps.labels("sample").set(float("nan"))  # not finite: left out, not shown as NaN
    mem = Gauge("tinkerflow_device_memory_in_use_bytes", "m", ["device"], registry=reg)
    mem.labels("cpu:0").set(100)
    mem.labels("cpu:1").set(23)
    Gauge("tinkerflow_engine_mfu", "f", ["kind"], registry=reg).labels("forward_backward").set(0.25)
    out = summarize(generate_latest(reg).decode())
    assert out == {
        "tokens_per_second": {"forward_backward": 1234.5},
        "device_memory_in_use_bytes": 123,
        "mfu": {"forward_backward": 0.25},
    }
    assert summarize("") == {}

    # Paging (more runs than slots): the last minute's rate and latency, and what is resident and paged out.
    paging = CollectorRegistry()
    Gauge("tinkerflow_adapter_page_ins_per_second", "r", registry=paging).set(12.5)
    Gauge("tinkerflow_adapter_page_in_seconds_recent", "l", registry=paging).set(0.004)
    Gauge("tinkerflow_adapter_runs_paged", "p", registry=paging).set(36)
    Gauge("tinkerflow_adapter_slots_used", "s", registry=paging).set(4)
    assert summarize(generate_latest(paging).decode()) == {
        "page_ins_per_second": 12.5,
        "page_in_seconds_recent": 0.004,
        "runs_paged": 36,
        "slots_resident": 4,
    }

    assert worker_metrics_urls(Settings(state_dir=tmp_path)) == ()
    assert worker_metrics_urls(Settings(state_dir=tmp_path, metrics_port=9400, host="0.0.0.0")) == (
        "http://127.0.0.1:9400/metrics",
    )
    given = Settings(state_dir=tmp_path, metrics_port=9400, worker_metrics_urls=("http://w1:9/metrics",))
    assert worker_metrics_urls(given) == ("http://w1:9/metrics",)


def test_service_panel_says_when_a_worker_does_not_answer():
    wm = WorkerMetrics(urls=(f"http://127.0.0.1:{free_port()}/metrics",))
    assert asyncio.run(wm.read()) == [{"answered": False}]


def _returns(value):
    async def call():
        return value

    return call


class _Handle:
    def __init__(self, client: _FakeTemporal, workflow_id: str):
        self.client, self.workflow_id = client, workflow_id

    async def query(self, *_):
        self.client.queried.append(self.workflow_id)
        if self.workflow_id.endswith(":7"):
            raise RuntimeError("query timed out")  # the row must still show, from its search attributes
        n = int(self.workflow_id.rsplit(":", 1)[1])
        start = RunStart(
            model_id=self.workflow_id.removeprefix("training-run/"),
            session_id="s",
            owner="o",
            base_model="tiny",
            lora=LoraSpec(rank=4),
        )
        return RunState(start=start, step=n, status="ready", last_loss=1.5)


class _FakeTemporal:
    """list_workflows/get_workflow_handle as the console's listing uses them: 300 runs of one owner, newest first,
    plus a closed execution of one of them that visibility lists again."""

    def __init__(self, n: int):
        self.queried: list[str] = []
        self.listed: list[str] = []
        now = datetime.now(UTC)
        rows = [(f"training-run/sess-{i:03d}:train:{i}", now - timedelta(seconds=i)) for i in range(n)]
        rows.insert(3, rows[2])  # the same id listed twice (an earlier execution): shown once
        self.rows = rows

    async def list_workflows(self, query: str):
        self.listed.append(query)
        sessions = "WorkflowType = 'Session'" in query
        for workflow_id, started in self.rows:
            if sessions:  # each run's session; session 5 is named (its memo), the rest are not
                session_id = workflow_id.removeprefix("training-run/").split(":")[0]
                workflow_id = f"session/{session_id}"
            memo = {"display_name": "<b>Alpha</b> run"} if workflow_id.startswith("session/sess-005") else {}
            attrs = names.search_attributes((names.STATUS, "ready"), (names.STEP, 0), (names.BASE_MODEL, "tiny"))
            yield SimpleNamespace(
                id=workflow_id, start_time=started, typed_search_attributes=attrs, memo=_returns(memo)
            )

    def get_workflow_handle(self, workflow_id: str):
        return _Handle(self, workflow_id)


def test_hundreds_of_runs_are_paged_and_searched_on_the_server_asking_only_the_shown_rows():
    temporal = _FakeTemporal(300)
    svc = cast(Any, SimpleNamespace(client=temporal))
    page = asyncio.run(console_data.runs(q="", offset=0, limit=25, svc=svc, who="o"))
    assert page["total"] == 300 and page["offset"] == 0
    ids = [r["training_run_id"] for r in page["training_runs"]]
    assert ids == [f"sess-{i:03d}:train:{i}" for i in range(25)]  # newest first, the duplicate once
    assert len(temporal.queried) == 25  # one describe per shown row, not per run
    assert "TinkerflowOwner = 'o'" in temporal.listed[0]
    row7 = page["training_runs"][7]
    assert row7["status"] == "ready" and row7["step"] == 0 and row7["last_loss"] is None  # from search attributes
    assert page["training_runs"][8]["step"] == 8 and page["training_runs"][8]["last_loss"] == 1.5

    last = asyncio.run(console_data.runs(q="", offset=275, limit=25, svc=svc, who="o"))
    assert [r["training_run_id"] for r in last["training_runs"]][-1] == "sess-299:train:299"
    found = asyncio.run(console_data.runs(q="SESS-12", offset=0, limit=25, svc=svc, who="o"))
    assert found["total"] == 10 and {r["training_run_id"][:7] for r in found["training_runs"]} == {"sess-12"}
    assert asyncio.run(console_data.runs(q="nobody", offset=0, limit=25, svc=svc, who="o"))["total"] == 0
    # By name: a session's display name finds the session and its runs; the name is data, never query text.
    by_name = asyncio.run(console_data.runs(q="alpha", offset=0, limit=25, svc=svc, who="o"))
    assert [r["training_run_id"] for r in by_name["training_runs"]] == ["sess-005:train:5"]
    sessions = asyncio.run(console_data.sessions(q="ALPHA</b>", offset=0, limit=25, svc=svc, who="o"))
    assert sessions["total"] == 1 and sessions["sessions"][0]["session_id"] == "sess-005"
    assert all("alpha" not in q.lower() for q in temporal.listed)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(q=st.text(max_size=40))
def test_any_search_text_answers_the_rows_holding_it_and_nothing_else(q):
    temporal = _FakeTemporal(40)
    svc = cast(Any, SimpleNamespace(client=temporal))
    page = asyncio.run(console_data.runs(q=q, offset=0, limit=200, svc=svc, who="o"))
    needle = q.strip().lower()
    expected = [
        f"sess-{i:03d}:train:{i}"
        for i in range(40)
        if not needle
        or needle in f"sess-{i:03d}:train:{i}"
        or needle in "tiny"
        or (i == 5 and needle in "<b>alpha</b> run")
    ]
    assert [r["training_run_id"] for r in page["training_runs"]] == expected


def test_sign_in_says_what_a_key_means_here_without_a_key(http, tmp_path):
    r = http.get("/api/v1/console/sign_in")
    assert r.status_code == 200 and r.json()["api_keys_configured"] is True
    assert "each key is its own tenant" in r.json()["tenant_mode"] and KEY not in r.text
    address = f"127.0.0.1:{free_port()}"
    open_settings = Settings(state_dir=tmp_path, temporal_address=address)
    client = asyncio.run(Client.connect(address, lazy=True))
    with TestClient(create_app(open_settings, client=client)) as c:
        body = c.get("/api/v1/console/sign_in").json()
    assert body["api_keys_configured"] is False and "any key works" in body["tenant_mode"]
    assert "one tenant" in body["tenant_mode"]


@pytest.mark.parametrize(
    ("status", "reason", "shown"),
    [
        ("active", "", ("active", "")),
        ("timed_out", "no heartbeat for 120s", ("ended", "the client went away (no heartbeat for 120s)")),
        ("finished", "client finished: success", ("ended", "the client finished it: success")),
    ],
)
def test_a_session_whose_client_went_away_reads_ended_with_its_reason(status, reason, shown):
    assert console_status.session_shown(status, reason) == console_status.Shown(*shown)


@pytest.mark.parametrize(
    ("status", "error", "shown"),
    [
        ("ready", "", ("ready", "")),
        ("failed", "restoring the adapter failed: x", ("failed", "restoring the adapter failed: x")),
        (
            "closed",
            "session timed_out: no heartbeat for 120s",
            ("ended", "its session ended: the client went away (no heartbeat for 120s)"),
        ),
        (
            "closed",
            "session finished: client finished: success",
            ("ended", "its session ended: the client finished it: success"),
        ),
        ("closed", "", ("ended", "")),  # a row known only from its search attributes
    ],
)
def test_a_run_closed_with_its_session_reads_ended_not_error(status, error, shown):
    assert console_status.run_shown(status, error) == console_status.Shown(*shown)
