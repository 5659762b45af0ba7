"""Every series the Grafana dashboard (infra/grafana/tinkerflow.json) queries is one a running stack exports: the API's
/metrics (with an API key, as Prometheus sends it), the JAX worker's (--metrics-port) and `up`'s own
(--up-metrics-port); and, where a `prometheus` binary is installed, a real Prometheus scraping that stack answers
every query of the dashboard. The offline half (valid dashboard, every query parses) is tests/infra/test_grafana.py."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import time

import httpx
import pytest
import yaml

from tests.infra import dashboard as dash
from tinkerflow.cli.launch import free_port

pytestmark = pytest.mark.e2e


def scrape(part: str, url: str, headers: dict[str, str], patience_s: float = 300) -> str:
    """One scrape, as Prometheus makes it; a part another test just killed is given time to come back."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            answer = httpx.get(url, headers=headers, timeout=30)
            break
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    assert answer.status_code == 200, f"{part}: {url} answered {answer.status_code}"
    return answer.text


def test_every_series_the_dashboard_queries_is_exported_by_a_live_stack(stack, metrics_ports):
    endpoints = {
        "api": (f"{stack.base_url}/metrics", {"Authorization": f"Bearer {stack.api_key}"}),
        "jax-worker": (f"http://127.0.0.1:{metrics_ports['jax-worker']}/metrics", {}),
        "up": (f"http://127.0.0.1:{metrics_ports['up']}/metrics", {}),
    }
    exported = {part: dash.exported_names(scrape(part, url, headers)) for part, (url, headers) in endpoints.items()}

    # each part exports its own series (a name in the wrong process would never reach Prometheus from there)
    assert "tinkerflow_api_requests_total" in exported["api"]
    assert "tinkerflow_adapter_slots_total" in exported["jax-worker"]
    assert "tinkerflow_up_restarts_total" in exported["up"]
    missing = dash.missing_report(dash.load(), set().union(*exported.values()))
    assert not missing, "the dashboard queries series no live /metrics exports:\n" + "\n".join(
        f"  {name}: {', '.join(panels)}" for name, panels in sorted(missing.items())
    )


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary (Debian: apt install prometheus)")
def test_a_real_prometheus_scraping_the_stack_answers_every_dashboard_query(stack, metrics_ports, tmp_path):
    """The local recipe of docs/grafana.md (infra/grafana/local/prometheus.yaml) pointed at the shared stack: every
    query is valid PromQL to Prometheus itself, and the API's and the JAX worker's series arrive through it."""
    config = yaml.safe_load((dash.DASHBOARD.parent / "local" / "prometheus.yaml").read_text())
    config["global"]["scrape_interval"] = "1s"
    targets = {
        "tinkerflow-api": stack.base_url.removeprefix("http://"),
        "tinkerflow-jax-worker": f"127.0.0.1:{metrics_ports['jax-worker']}",
        "tinkerflow-up": f"127.0.0.1:{metrics_ports['up']}",
    }
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
        if job["job_name"] == "tinkerflow-api":
            job["authorization"] = {"type": "Bearer", "credentials": stack.api_key}
    (tmp_path / "prometheus.yaml").write_text(yaml.safe_dump(config))
    port = free_port()
    prometheus = subprocess.Popen(
        [
            shutil.which("prometheus") or "prometheus",
            f"--config.file={tmp_path / 'prometheus.yaml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def query(expr: str) -> dict:
        # Grafana's interval variables: a rate window of several 1 s scrapes, the range of the test
        expr = re.sub(r"\$__rate_interval|\$__interval", "15s", expr).replace("$__range", "10m")
        return httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": expr}, timeout=30).json()

    try:
        deadline = time.monotonic() + 300
        while True:  # until every target has been scraped a few times (rate() needs two points)
            try:
                up = query("count_over_time(up[1m]) > 3")
                if up["status"] == "success" and len(up["data"]["result"]) == len(targets):
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "prometheus did not scrape all three targets"
            time.sleep(1)
        health = query("up")["data"]["result"]
        assert {r["metric"]["job"]: r["value"][1] for r in health} == dict.fromkeys(targets, "1")

        answered = {}
        for q in dash.queries(dash.load()):
            answer = query(q.expr)
            assert answer["status"] == "success", f"{q.panel} ({q.ref_id}): {answer.get('error')}"
            answered[(q.panel, q.ref_id)] = len(answer["data"]["result"])
        # series every stack has from its first requests on: the API's routes, the worker's slots, up's parts
        for panel in ("Request rate by route", "Op latency by route (p95)", "Adapter slots used / total"):
            assert answered[(panel, "A")] > 0, panel
        assert answered[("Restarts by part (total)", "A")] == 4  # temporal, workflow-worker, jax-worker, api
    finally:
        prometheus.send_signal(signal.SIGTERM)
        prometheus.wait(timeout=60)
