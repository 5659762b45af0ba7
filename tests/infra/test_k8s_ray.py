"""infra/k8s/ray/: the KubeRay RayJob that runs `tinkerflow ray --with-stack`, offline. Every overlay renders (the
built-in renderer agrees with kubectl), the RayJob validates against the KubeRay v1 schema (tests/infra/
kuberay_schema.py), its pod templates and the core objects validate strictly, and the entrypoint's placement flags
agree with the pods that Ray will find (hosts, per-host resources, API port)."""

from __future__ import annotations

import copy
import shlex

import pytest

from tests.infra.conftest import K8S, kubectl, one, render, render_kubectl
from tests.infra.kuberay_schema import RAYJOB
from tests.infra.kustomize_lite import render as render_lite

jsonschema = pytest.importorskip("jsonschema")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

OVERLAYS = ["ray/base", "ray/gpu", "ray/tpu"]
K8S_VERSION = "1.32"
ACCELERATOR = {"nvidia.com/gpu": "ray_gpus_per_host", "google.com/tpu": "ray_tpus_per_host"}


@pytest.fixture(params=OVERLAYS)
def overlay(request) -> str:
    return request.param


def _rayjob(overlay: str) -> dict:
    return one(render(overlay), "RayJob", "tinkerflow")


def _quantity(value) -> float:
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def test_overlay_renders_and_kubectl_agrees(overlay):
    kinds = {o["kind"] for o in render(overlay)}
    assert kinds == {"Namespace", "ServiceAccount", "ConfigMap", "RayJob"}
    if kubectl():

        def keyed(objects):
            return {(o["kind"], o["metadata"]["name"]): o for o in objects}

        assert keyed(render_lite(K8S / overlay)) == keyed(render_kubectl(overlay))


def test_rayjob_matches_the_kuberay_schema_and_pods_validate(overlay):
    job = _rayjob(overlay)
    jsonschema.validate(job, RAYJOB)
    cluster = job["spec"]["rayClusterSpec"]
    templates = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for n, template in enumerate(templates):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"pod-{n}", **template.get("metadata", {})},
            "spec": copy.deepcopy(template["spec"]),
        }
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)
    for o in render(overlay):
        if o["kind"] != "RayJob":
            kubernetes_validate.validate(copy.deepcopy(o), K8S_VERSION, strict=True)


def test_schema_refuses_a_misplaced_field():
    job = copy.deepcopy(_rayjob("ray/base"))
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["numHosts"] = 4  # the field is numOfHosts
    with pytest.raises(jsonschema.ValidationError, match="numHosts"):
        jsonschema.validate(job, RAYJOB)


def test_entrypoint_agrees_with_the_pods_ray_will_find(overlay):
    from tinkerflow.cli import ray_plan
    from tinkerflow.cli.main import build_parser
    from tinkerflow.common.settings import Settings

    job = _rayjob(overlay)
    argv = shlex.split(job["spec"]["entrypoint"])
    assert argv[:2] == ["tinkerflow", "ray"] and "--with-stack" in argv
    args = build_parser().parse_args(argv[1:])  # our own CLI accepts every flag
    config = one(render(overlay), "ConfigMap", "tinkerflow-ray-config")["data"]
    settings = Settings().with_args(args)
    group = ray_plan.plan(settings)

    cluster = job["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0", "no JAX actor may land on the head"
    head_ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert settings.port in head_ports and settings.host == "0.0.0.0"
    assert config["TINKERFLOW_TEMPORAL_ADDRESS"], "Temporal stays outside the Ray cluster (its Helm release)"

    (jax,) = cluster["workerGroupSpecs"]
    assert jax["replicas"] == jax["minReplicas"] == jax["maxReplicas"], "a fixed number of hosts"
    assert group.hosts == jax["replicas"] * jax.get("numOfHosts", 1)
    requests = jax["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert group.bundle["CPU"] <= _quantity(requests["cpu"])
    for resource, field in ACCELERATOR.items():
        assert getattr(settings, field) == _quantity(requests.get(resource, 0)), resource
    if group.hosts > 1 and overlay != "ray/base":  # several real nodes: every host must reach the same store
        assert config["TINKERFLOW_STORE_URL"].startswith("gs://")
        assert config["TINKERFLOW_CHECKPOINT_ROOT"].startswith("gs://")
    if "google.com/tpu" in requests:
        assert group.strategy == "STRICT_SPREAD" and jax["numOfHosts"] == group.hosts, "one slice, one host each"
