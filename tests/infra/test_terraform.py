"""infra/terraform parses (python-hcl2) and declares what the deployment needs; `terraform fmt` where a binary is."""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache

import pytest

from tests.infra.conftest import K8S, TERRAFORM, one, render

hcl2 = pytest.importorskip("hcl2", reason="python-hcl2 is not installed (pip install 'python-hcl2>=8,<9')")

EXPECTED_FILES = {
    "versions.tf",
    "main.tf",
    "variables.tf",
    "outputs.tf",
    "gke.tf",
    "storage.tf",
    "iam.tf",
    "network.tf",
    "registry.tf",
}


def _unquote(value):
    """python-hcl2 >= 7 keeps string literals quoted ('"x"'); older versions do not."""
    if isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] == '"':
        return value[1:-1]
    return value


def _plain(node):
    if isinstance(node, dict):
        return {_unquote(k): _plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_plain(v) for v in node]
    return _unquote(node)


@cache
def parsed() -> dict[str, dict]:
    out = {}
    for path in sorted(TERRAFORM.glob("*.tf")):
        with path.open() as f:
            out[path.name] = _plain(hcl2.load(f))
    return out


def blocks(kind: str) -> dict:
    """{type: {name: body}} for resource/data, {name: body} for variable/output, merged over all files."""
    merged: dict = {}
    for doc in parsed().values():
        for entry in doc.get(kind, []):
            for key, body in entry.items():
                if kind in ("resource", "data"):
                    for name, inner in body.items():
                        merged.setdefault(key, {})[name] = inner
                else:
                    merged[key] = body
    return merged


def block(body: dict, name: str):
    """A nested block: python-hcl2 gives a list of bodies."""
    value = body[name]
    return value[0] if isinstance(value, list) else value


def test_files_split_by_concern_and_all_parse():
    assert set(parsed()) >= EXPECTED_FILES


def test_required_resources_exist():
    r = blocks("resource")
    for rtype, name in [
        ("google_container_cluster", "this"),
        ("google_container_node_pool", "system"),
        ("google_container_node_pool", "gpu"),
        ("google_container_node_pool", "tpu"),
        ("google_storage_bucket", "checkpoints"),
        ("google_storage_bucket", "claim_checks"),
        ("google_artifact_registry_repository", "images"),
        ("google_service_account", "app"),
        ("google_service_account", "nodes"),
        ("google_service_account_iam_member", "workload_identity"),
        ("google_storage_bucket_iam_member", "app_objects"),
        ("google_artifact_registry_repository_iam_member", "nodes_pull"),
        ("google_project_service", "apis"),
    ]:
        assert name in r.get(rtype, {}), f"missing {rtype}.{name}"


def test_cluster_has_workload_identity_and_no_default_pool():
    cluster = blocks("resource")["google_container_cluster"]["this"]
    assert block(cluster, "workload_identity_config")["workload_pool"] == "${local.workload_pool}"
    local_values = {k: v for doc in parsed().values() for entry in doc.get("locals", []) for k, v in entry.items()}
    assert local_values["workload_pool"].endswith(".svc.id.goog")
    assert cluster["remove_default_node_pool"] is True
    assert "private_cluster_config" in str(cluster.get("dynamic", "")), "private nodes must be optional (dynamic)"


def test_every_node_pool_uses_gke_metadata_server_and_shielded_nodes():
    for name, pool in blocks("resource")["google_container_node_pool"].items():
        cfg = block(pool, "node_config")
        assert block(cfg, "workload_metadata_config")["mode"] == "GKE_METADATA", name
        assert block(cfg, "shielded_instance_config")["enable_secure_boot"] is True, name
        assert "nodes.email" in cfg["service_account"], f"{name} must not run as the default compute account"


def test_gpu_pool_is_h100_with_taint():
    pool = blocks("resource")["google_container_node_pool"]["gpu"]
    cfg = block(pool, "node_config")
    accel = block(cfg, "guest_accelerator")
    assert accel["type"] == "nvidia-h100-80gb"
    taint = block(cfg, "taint")
    assert taint["key"] == "nvidia.com/gpu" and taint["effect"] == "NO_SCHEDULE"
    default_machine = blocks("variable")["gpu_machine_type"]["default"]
    assert default_machine.startswith("a3-highgpu")


def test_tpu_pool_is_v6e_4x4_with_compact_placement():
    pool = blocks("resource")["google_container_node_pool"]["tpu"]
    placement = block(pool, "placement_policy")
    assert placement["type"] == "COMPACT" and placement["tpu_topology"] == "${var.tpu_topology}"
    variables = blocks("variable")
    assert variables["tpu_topology"]["default"] == "4x4"
    assert variables["tpu_machine_type"]["default"].startswith("ct6e-")
    assert block(block(pool, "node_config"), "taint")["key"] == "google.com/tpu"


def test_claim_checks_expire_and_checkpoints_are_versioned():
    buckets = blocks("resource")["google_storage_bucket"]
    claim = buckets["claim_checks"]
    rules = claim["lifecycle_rule"]
    deletes = [r for r in rules if block(r, "action")["type"] == "Delete"]
    assert any(block(r, "condition").get("age") == "${var.claim_check_retention_days}" for r in deletes)
    assert block(buckets["checkpoints"], "versioning")["enabled"] is True
    for b in buckets.values():
        assert b["uniform_bucket_level_access"] is True
        assert b["public_access_prevention"] == "enforced"


def test_iam_is_least_privilege():
    text = "\n".join(p.read_text() for p in TERRAFORM.glob("*.tf"))
    # No project-wide storage or owner/editor roles; buckets are granted object admin one by one.
    for role in ("roles/storage.admin", "roles/owner", "roles/editor", 'roles/storage.objectAdmin"\n  project'):
        assert role not in text
    assert re.search(r'role\s*=\s*"roles/storage.objectAdmin"', text)
    assert re.search(r'role\s*=\s*"roles/artifactregistry.reader"', text)
    assert re.search(r'role\s*=\s*"roles/iam.workloadIdentityUser"', text)
    project_roles = blocks("resource")["google_project_iam_member"]
    assert set(project_roles) == {"nodes"}, "only the node account gets project roles (logging/monitoring)"


def test_every_variable_has_description_and_type():
    variables = blocks("variable")
    assert len(variables) >= 20
    for name, body in variables.items():
        assert body.get("description"), f"variable {name} has no description"
        assert "type" in body, f"variable {name} has no type"


def test_validations_on_the_variables_that_need_them():
    variables = blocks("variable")
    must_validate = [
        "project_id",
        "region",
        "zone",
        "name",
        "tpu_topology",
        "gpu_machine_type",
        "tpu_zones",
        "claim_check_retention_days",
        "k8s_namespace",
        "master_authorized_networks",
        "release_channel",
        "image_tag",
        "k8s_overlay",
        "subnet_cidr",
    ]
    for name in must_validate:
        validation = variables[name].get("validation")
        assert validation, f"variable {name} has no validation block"
        v = validation[0] if isinstance(validation, list) else validation
        assert v.get("condition") and v.get("error_message"), name


def test_outputs_the_manifests_need():
    outputs = blocks("output")
    for name in [
        "cluster_name",
        "cluster_location",
        "registry_path",
        "checkpoints_bucket_url",
        "claim_checks_bucket_url",
        "api_service_account_email",
        "jax_worker_service_account_email",
        "store_url",
        "site_kustomization",
    ]:
        assert name in outputs and outputs[name].get("description"), f"output {name}"


def test_workload_identity_names_match_the_manifests():
    """The KSA names and namespace bound in iam.tf are the ones infra/k8s creates."""
    text = (TERRAFORM / "iam.tf").read_text()
    base = render("base")
    namespace = blocks("variable")["k8s_namespace"]["default"]
    for ksa in ("tinkerflow-api", "tinkerflow-jax-worker"):
        assert f'ksa         = "{ksa}"' in text
        sa = one(base, "ServiceAccount", ksa)
        assert sa["metadata"]["namespace"] == namespace
        assert sa["metadata"]["annotations"]["iam.gke.io/gcp-service-account"].startswith(f"{ksa}@")
    # The generated site kustomization patches the JobSet volume by index: hf-cache must stay volumes[2].
    for overlay in ("gpu", "tpu"):
        js = one(render(overlay), "JobSet", "tinkerflow-jax")
        vols = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["volumes"]
        assert vols[2]["name"] == "hf-cache" and vols[2]["csi"]["driver"] == "gcsfuse.csi.storage.gke.io"
    # ... and removes the cpu overlay's RWO store volume by index (api volumes[2], JobSet volumes[3]).
    cpu = render("cpu")
    api = one(cpu, "Deployment", "tinkerflow-api")["spec"]["template"]["spec"]
    assert api["volumes"][2]["name"] == api["containers"][0]["volumeMounts"][2]["name"] == "store"
    js = one(cpu, "JobSet", "tinkerflow-jax")["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert js["volumes"][3]["name"] == js["containers"][0]["volumeMounts"][3]["name"] == "store"
    outputs_tf = (TERRAFORM / "outputs.tf").read_text()
    for path in (
        "/spec/template/spec/volumes/2",
        "/spec/replicatedJobs/0/template/spec/template/spec/volumes/3",
        "/spec/replicatedJobs/0/template/spec/template/spec/volumes/2/csi/volumeAttributes/bucketName",
    ):
        assert f'"{path}' in outputs_tf, path
    assert (K8S / "cpu").is_dir()


@pytest.mark.skipif(not shutil.which("terraform"), reason="no terraform binary on this machine")
def test_terraform_fmt():
    proc = subprocess.run(
        ["terraform", "fmt", "-check", "-recursive", "-diff", str(TERRAFORM)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
