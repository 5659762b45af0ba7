# Least privilege, one Google service account per role:
#
#   GSA                       bound to KSA (Workload Identity)              may
#   <name>-nodes              (node VMs)                                     write logs/metrics, pull images
#   <name>-api                <ns>/tinkerflow-api                            objects in the claim-check bucket
#   <name>-jax-worker         <ns>/tinkerflow-jax-worker                     objects in both buckets
#
# The workflow worker does no I/O (docs/architecture.md §The workflows), so its KSA gets no Google identity at all.
# Image pulls are done by the kubelet with the node's identity, hence artifact reader on the node GSA.

locals {
  app_accounts = {
    api = {
      ksa         = "tinkerflow-api"
      description = "tinkerflow API adapter: writes request bodies and reads results in the claim-check store"
      buckets     = { claim_checks = google_storage_bucket.claim_checks.name }
    }
    jax-worker = {
      ksa         = "tinkerflow-jax-worker"
      description = "tinkerflow JAX workers: claim checks, checkpoints and the read-only HF model cache"
      buckets = {
        claim_checks = google_storage_bucket.claim_checks.name
        checkpoints  = google_storage_bucket.checkpoints.name
      }
    }
  }

  bucket_grants = merge([
    for role, acct in local.app_accounts : {
      for key, bucket in acct.buckets : "${role}/${key}" => { role = role, bucket = bucket }
    }
  ]...)

  node_roles = [
    "roles/logging.logWriter",
    "roles/monitoring.metricWriter",
    "roles/monitoring.viewer",
    "roles/stackdriver.resourceMetadata.writer",
    "roles/autoscaling.metricsWriter",
  ]
}

# --- Nodes -----------------------------------------------------------------------------------------------------------
resource "google_service_account" "nodes" {
  account_id   = "${var.name}-nodes"
  display_name = "tinkerflow GKE nodes"
  description  = "Minimal identity of the GKE node VMs (instead of the Compute Engine default account)"
  depends_on   = [google_project_service.apis]
}

resource "google_project_iam_member" "nodes" {
  for_each = toset(local.node_roles)
  project  = var.project_id
  role     = each.value
  member   = "serviceAccount:${google_service_account.nodes.email}"
}

resource "google_artifact_registry_repository_iam_member" "nodes_pull" {
  location   = google_artifact_registry_repository.images.location
  repository = google_artifact_registry_repository.images.name
  role       = "roles/artifactregistry.reader"
  member     = "serviceAccount:${google_service_account.nodes.email}"
}

# --- Workloads -------------------------------------------------------------------------------------------------------
resource "google_service_account" "app" {
  for_each = local.app_accounts

  account_id   = "${var.name}-${each.key}"
  display_name = "tinkerflow ${each.key}"
  description  = each.value.description
  depends_on   = [google_project_service.apis]
}

# Only the Kubernetes service account of the same role may act as this GSA.
resource "google_service_account_iam_member" "workload_identity" {
  for_each = local.app_accounts

  service_account_id = google_service_account.app[each.key].name
  role               = "roles/iam.workloadIdentityUser"
  member             = "serviceAccount:${local.workload_pool}[${var.k8s_namespace}/${each.value.ksa}]"

  # The workload pool exists once the cluster does.
  depends_on = [google_container_cluster.this]
}

# Object admin on the named buckets only: no project-wide storage role, no bucket admin (cannot change IAM or
# lifecycle).
resource "google_storage_bucket_iam_member" "app_objects" {
  for_each = local.bucket_grants

  bucket = each.value.bucket
  role   = "roles/storage.objectAdmin"
  member = "serviceAccount:${google_service_account.app[each.value.role].email}"
}
