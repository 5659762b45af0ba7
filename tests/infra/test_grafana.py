"""The Grafana dashboard (infra/grafana/tinkerflow.json) is a valid dashboard whose every query parses and reads only
series tinkerflow defines, and the monitoring overlay provisions it with the scrapes it needs.

The same names are checked against live /metrics endpoints of a running stack in tests/e2e/test_grafana_live.py."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
from collections import Counter

import prometheus_client
import pytest

from tests.infra import dashboard as dash
from tests.infra.conftest import INFRA, one, render

# What the dashboard must show, by the series it reads.
REQUIRED = {
    "tinkerflow_api_request_seconds_bucket",  # op latency by route
    "tinkerflow_api_requests_total",  # request and error rate
    "tinkerflow_sampling_queue_depth",
    "tinkerflow_engine_tokens_total",  # tokens/s and tokens by kind
    "tinkerflow_adapter_slots_used",
    "tinkerflow_adapter_slots_total",
    "tinkerflow_device_memory_in_use_bytes",
    "tinkerflow_device_memory_peak_bytes",
    "tinkerflow_engine_mfu",
    "tinkerflow_up_restarts_total",
    "tinkerflow_tenant_training_tokens_total",  # per tenant (key id): usage and quota refusals
    "tinkerflow_tenant_sampled_tokens_total",
    "tinkerflow_tenant_quota_refusals_total",
}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return dash.load()


def test_dashboard_is_a_valid_grafana_dashboard(dashboard):
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] and dashboard["title"]
    panels = list(dash.panels(dashboard))
    ids = Counter(p["id"] for p in panels)
    assert not [i for i, n in ids.items() if n > 1], f"duplicate panel ids: {ids}"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"{p['title']}: no queries"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(set(ref_ids)) == len(ref_ids), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip(), p["title"]


def test_every_query_parses_and_reads_a_metric(dashboard):
    queries = dash.queries(dashboard)
    assert queries
    for q in queries:
        assert dash.metric_names(q.expr), f"{q.panel} ({q.ref_id}) reads no metric: {q.expr}"


def test_the_dashboard_shows_what_the_issue_asks(dashboard):
    read = set().union(*(dash.metric_names(q.expr) for q in dash.queries(dashboard)))
    assert read >= REQUIRED, sorted(REQUIRED - read)


def test_every_metric_the_dashboard_reads_is_one_tinkerflow_defines(dashboard):
    """Offline: the series the API, the JAX worker and `up` register (their modules, imported here) cover every
    query; the live endpoints are checked in tests/e2e/test_grafana_live.py."""
    # importing them registers their series (the API's and the worker's, and up's tinkerflow_up_restarts_total)
    for module in ("tinkerflow.common.metrics", "tinkerflow.cli.supervise"):
        importlib.import_module(module)
    exported = dash.exported_names(prometheus_client.generate_latest(prometheus_client.REGISTRY).decode())
    missing = dash.missing_report(dashboard, exported)
    assert not missing, "the dashboard queries series nothing defines:\n" + "\n".join(
        f"  {name}: {', '.join(panels)}" for name, panels in sorted(missing.items())
    )


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("histogram_quantile(0.95, sum by (le, route) (rate(a_bucket[$__rate_interval])))", {"a_bucket"}),
        # label names, function names and grouping labels are not metrics; `or`/`unless` operands are
        ('sum by (kind) (rate(b_total{kind="sample", rate="x"}[5m])) or on (kind) c unless d', {"b_total", "c", "d"}),
        ('{__name__="e", job="x"} / ignoring (job) group_left f offset 5m', {"e", "f"}),
        ("max_over_time(g[${__range}:1m]) > bool 0", {"g"}),
        ("-h + vector(1) * scalar(i)", {"h", "i"}),
    ],
)
def test_metric_names_are_extracted_by_a_promql_parser(expr, names):
    assert dash.metric_names(expr) == names


def test_a_regex_on_metric_names_is_refused():
    with pytest.raises(ValueError, match="__name__"):
        dash.metric_names('{__name__=~"tinkerflow_.*"}')


def test_exported_names_expand_families_by_type():
    text = (
        "# TYPE a_total counter\n# TYPE b_seconds histogram\n# TYPE c gauge\nc 1.0\n"
        '# TYPE d summary\nd_sum 1.0\nd_count{x="y"} 1.0\n'
    )
    names = dash.exported_names(text)
    assert {"a_total", "b_seconds_bucket", "b_seconds_sum", "b_seconds_count", "c", "d_sum", "d_count"} <= names
    assert "a" not in names and "b_seconds" not in names


def test_monitoring_overlay_provisions_the_dashboard_and_its_scrapes():
    objects = render("monitoring")
    cm = one(objects, "ConfigMap", "tinkerflow-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    # generated from the one JSON file, byte for byte
    assert cm["data"] == {"tinkerflow.json": (INFRA / "grafana" / "tinkerflow.json").read_text()}
    assert json.loads(cm["data"]["tinkerflow.json"])["uid"] == dash.load()["uid"]

    api_svc = one(objects, "Service", "tinkerflow-api")
    sm = one(objects, "ServiceMonitor", "tinkerflow-api")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["spec"]["selector"]["matchLabels"].items() <= api_svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in api_svc["spec"]["ports"]} and endpoint["path"] == "/metrics"
    # the API's /metrics wants an API key (--metrics-access key): the token Secret exists in the namespace
    creds = endpoint["authorization"]["credentials"]
    assert creds["key"] in one(objects, "Secret", creds["name"])["stringData"]

    pm = one(objects, "PodMonitor", "tinkerflow-jax-worker")
    jobset = one(objects, "JobSet", "tinkerflow-jax")
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    (pod_endpoint,) = pm["spec"]["podMetricsEndpoints"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert int(env["TINKERFLOW_METRICS_PORT"]) == ports[pod_endpoint["port"]]
    assert env["TINKERFLOW_HOST"] == "0.0.0.0"  # /metrics binds --host

    policy = one(objects, "NetworkPolicy", "tinkerflow-jax-metrics")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["spec"]["ingress"][0]["ports"] == [{"port": pod_endpoint["port"], "protocol": "TCP"}]


def test_other_overlays_stay_free_of_operator_resources(overlay):
    """ServiceMonitor/PodMonitor need the Prometheus operator; only overlays that ask for monitoring carry them."""
    kinds = {o["kind"] for o in render(overlay)}
    assert ("ServiceMonitor" in kinds) == (overlay == "monitoring")


@pytest.mark.skipif(shutil.which("promtool") is None, reason="no promtool (Debian: apt install prometheus)")
def test_the_local_prometheus_config_is_valid():
    """docs/grafana.md's local recipe: Prometheus' own checker accepts its scrape config."""
    check = subprocess.run(
        [
            shutil.which("promtool") or "promtool",
            "check",
            "config",
            str(INFRA / "grafana" / "local" / "prometheus.yaml"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stdout + check.stderr
