"""Every series the Grafana dashboard (infra/grafana/tinkerflow.json) queries is one a running stack exports: the API's
/metrics (with an API key, as Prometheus sends it), the JAX worker's (--metrics-port) and `up`'s own
(--up-metrics-port). The offline half (valid dashboard, every query parses) is tests/infra/test_grafana.py."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.infra import dashboard as dash

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
