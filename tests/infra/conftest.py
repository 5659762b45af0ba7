"""Offline checks of the deployment artifacts under infra/ (no cloud, no cluster, no network)."""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest
import yaml

from tests.infra.kustomize_lite import render as render_lite

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
K8S = INFRA / "k8s"
TERRAFORM = INFRA / "terraform"
OVERLAYS = ["base", "cpu", "gpu", "tpu", "temporal-cloud", "monitoring"]


def kubectl() -> str | None:
    return shutil.which("kubectl")


@cache
def render_kubectl(overlay: str) -> tuple[dict, ...]:
    out = subprocess.run(
        [kubectl(), "kustomize", str(K8S / overlay)],  # pyright: ignore[reportArgumentType, reportCallIssue] (skipped when kubectl is absent)
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return tuple(d for d in yaml.safe_load_all(out) if d)


@cache
def render(overlay: str) -> tuple[dict, ...]:
    """The overlay as kustomize renders it: `kubectl kustomize` where a binary exists, else the built-in renderer."""
    if kubectl():
        return render_kubectl(overlay)
    return tuple(render_lite(K8S / overlay))


def by_kind(objects, kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects, kind: str, name: str) -> dict:
    hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind}/{name}, found {len(hits)}"
    return hits[0]


def pod_specs(objects):
    """(owner, pod spec) for every workload: Deployments and the JobSet's replicated jobs."""
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield f"{o['kind']}/{o['metadata']['name']}", o["spec"]["template"]["spec"]
        elif o["kind"] == "JobSet":
            for rj in o["spec"]["replicatedJobs"]:
                yield f"JobSet/{o['metadata']['name']}/{rj['name']}", rj["template"]["spec"]["template"]["spec"]


@pytest.fixture(params=OVERLAYS)
def overlay(request) -> str:
    return request.param
