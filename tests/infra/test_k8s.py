"""Every overlay renders, every object validates, and every container is probed and sized."""

from __future__ import annotations

import copy

import pytest
import yaml

from tests.infra.conftest import K8S, by_kind, kubectl, one, pod_specs, render, render_kubectl
from tests.infra.kustomize_lite import render as render_lite

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed (pip install kubernetes-validate)"
)

K8S_VERSION = "1.32"  # GKE REGULAR channel at the time of writing
CRDS = {"JobSet", "ServiceMonitor", "PodMonitor"}  # not in kubernetes-validate's schemas; checked structurally


def test_overlay_renders(overlay):
    objects = render(overlay)
    kinds = {o["kind"] for o in objects}
    assert {
        "Namespace",
        "ConfigMap",
        "Secret",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "JobSet",
        "ServiceAccount",
    } <= kinds
    for o in objects:
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == "tinkerflow", f"{o['kind']}/{o['metadata']['name']}"


@pytest.mark.skipif(not kubectl(), reason="no kubectl binary: the built-in renderer is the only one here")
def test_builtin_renderer_agrees_with_kubectl_kustomize(overlay):
    def keyed(objects):
        return {(o["kind"], o["metadata"]["name"]): o for o in objects}

    assert keyed(render_lite(K8S / overlay)) == keyed(render_kubectl(overlay))


def test_core_objects_validate_strictly(overlay):
    for o in render(overlay):
        if o["kind"] in CRDS:
            continue
        kubernetes_validate.validate(copy.deepcopy(o), K8S_VERSION, strict=True)


def test_jobset_is_structurally_valid(overlay):
    """JobSet v1alpha2: its replicated jobs' templates are batch/v1 Job specs, validated as Jobs."""
    js = one(render(overlay), "JobSet", "tinkerflow-jax")
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    spec = js["spec"]
    assert set(spec) <= {
        "replicatedJobs",
        "network",
        "successPolicy",
        "failurePolicy",
        "startupPolicy",
        "suspend",
        "coordinator",
        "managedBy",
        "ttlSecondsAfterFinished",
    }
    assert spec["network"]["enableDNSHostnames"] is True
    for rj in spec["replicatedJobs"]:
        assert set(rj) <= {"name", "replicas", "template", "dependsOn"}
        job = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"{js['metadata']['name']}-{rj['name']}"},
            "spec": copy.deepcopy(rj["template"]["spec"]),
        }
        kubernetes_validate.validate(job, K8S_VERSION, strict=True)
        assert rj["template"]["spec"]["completionMode"] == "Indexed"


def _env(container) -> dict:
    return {e["name"]: e for e in container.get("env", [])}


def test_jobset_multihost_wiring(overlay):
    js = one(render(overlay), "JobSet", "tinkerflow-jax")
    rj = js["spec"]["replicatedJobs"][0]
    job = rj["template"]["spec"]
    container = job["template"]["spec"]["containers"][0]
    env = _env(container)
    # Process id from the Job completion index; process count = hosts; coordinator = host 0 via the headless DNS.
    assert (
        env["TINKERFLOW_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
        == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    )
    assert int(env["TINKERFLOW_NUM_PROCESSES"]["value"]) == job["parallelism"] == job["completions"]
    subdomain = js["spec"]["network"]["subdomain"]
    host0 = f"{js['metadata']['name']}-{rj['name']}-0-0.{subdomain}"
    address = env["TINKERFLOW_COORDINATOR_ADDRESS"]["value"]
    assert address.startswith(host0 + ":")
    assert int(address.rsplit(":", 1)[1]) in {p["containerPort"] for p in container["ports"]}


def test_every_container_has_probes_resources_and_a_locked_down_context(overlay):
    for owner, spec in pod_specs(render(overlay)):
        assert spec.get("automountServiceAccountToken") is False, owner
        assert spec["securityContext"]["runAsNonRoot"] is True, owner
        for c in spec["containers"]:
            where = f"{owner}/{c['name']}"
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                assert probe in c, f"{where} has no {probe}"
            res = c["resources"]
            for kind in ("cpu", "memory"):
                assert kind in res["requests"] and kind in res["limits"], f"{where} {kind}"
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, where
            assert sc["capabilities"]["drop"] == ["ALL"], where


def _jax_pod(overlay):
    js = one(render(overlay), "JobSet", "tinkerflow-jax")
    return js, js["spec"]["replicatedJobs"][0]["template"]["spec"]


def test_gpu_overlay_asks_for_h100s():
    _, job = _jax_pod("gpu")
    pod = job["template"]["spec"]
    res = pod["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == "8"
    assert pod["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-h100-80gb"
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert pod["containers"][0]["image"].endswith(":cuda")
    assert job["template"]["metadata"]["annotations"]["gke-gcsfuse/volumes"] == "true"


def test_tpu_overlay_asks_for_a_v6e_4x4_slice():
    js, job = _jax_pod("tpu")
    pod = job["template"]["spec"]
    res = pod["containers"][0]["resources"]
    assert res["limits"]["google.com/tpu"] == res["requests"]["google.com/tpu"] == "4"
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "4x4",
    }
    assert any(t["key"] == "google.com/tpu" for t in pod["tolerations"])
    # 4x4 = 16 chips / 4 per host = 4 hosts = 4 processes.
    assert job["parallelism"] == job["completions"] == 4
    assert (
        js["metadata"]["annotations"]["alpha.jobset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"
    )
    assert pod["containers"][0]["image"].endswith(":tpu")


def test_accelerator_overlays_share_the_claim_check_store_through_gcs():
    for overlay in ("gpu", "tpu"):
        cm = one(render(overlay), "ConfigMap", "tinkerflow-config")
        assert cm["data"]["TINKERFLOW_STORE_URL"].startswith("gs://")
        assert cm["data"]["TINKERFLOW_BASE_MODEL"] == "Qwen/Qwen3-8B"


def test_api_service_hpa_and_ports_line_up(overlay):
    objects = render(overlay)
    dep = one(objects, "Deployment", "tinkerflow-api")
    svc = one(objects, "Service", "tinkerflow-api")
    hpa = one(objects, "HorizontalPodAutoscaler", "tinkerflow-api")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert ports["http"] == int(env["TINKERFLOW_PORT"]) == 8000
    assert env["TINKERFLOW_HOST"] == "0.0.0.0"
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == {"http"}
    # readiness checks the dependencies (Temporal, the store); liveness only the process, so an outage never
    # restarts healthy pods
    assert container["readinessProbe"]["httpGet"]["path"] == "/api/v1/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/api/v1/healthz"
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"


def test_references_resolve(overlay):
    """Every ConfigMap/Secret/ServiceAccount/PVC a pod names exists in the same render (temporal-cloud's mTLS Secret
    is created by hand, as its component says)."""
    objects = render(overlay)
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    external = {("Secret", "temporal-cloud-mtls")}
    for owner, spec in pod_specs(objects):
        assert ("ServiceAccount", spec["serviceAccountName"]) in names, owner
        for c in spec["containers"]:
            for src in c.get("envFrom", []):
                for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                    if key in src:
                        assert (kind, src[key]["name"]) in names, owner
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in names, owner
            if "secret" in v:
                ref = ("Secret", v["secret"]["secretName"])
                assert ref in names or ref in external, owner
        mounts = {m["name"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
        assert mounts <= {v["name"] for v in spec.get("volumes", [])}, owner


def test_temporal_values_raise_the_update_limits_and_name_the_search_attributes():
    from tinkerflow.cli.temporal_server import DYNAMIC_CONFIG
    from tinkerflow.workflows.protocol import names

    values = yaml.safe_load((K8S / "temporal" / "values.yaml").read_text())
    dynamic = values["server"]["dynamicConfig"]
    assert dynamic["history.maxInFlightUpdates"][0]["value"] == 256
    assert dynamic["history.maxTotalUpdates"][0]["value"] == 4000
    for key, value in DYNAMIC_CONFIG.items():
        assert str(dynamic[key][0]["value"]) == value, key
    job = next(o for o in values["extraObjects"] if o["kind"] == "Job")
    script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
    for key in names.SEARCH_ATTRIBUTES:
        kind = key.indexed_value_type.name.title().replace("_", "")
        assert f"{key.name}={kind}" in script
    # The app's default namespace exists, and the frontend is where the base ConfigMap points.
    assert {"name": "default", "retention": "3d"} in values["server"]["config"]["namespaces"]["namespace"]
    cm = one(render("base"), "ConfigMap", "tinkerflow-config")
    assert cm["data"]["TINKERFLOW_TEMPORAL_ADDRESS"].startswith("temporal-frontend.temporal.svc")


def test_cpu_overlay_is_single_node_friendly():
    objects = render("cpu")
    for dep in by_kind(objects, "Deployment"):
        assert dep["spec"]["replicas"] == 1
    assert one(objects, "PodDisruptionBudget", "tinkerflow-api")["spec"]["minAvailable"] == 0
