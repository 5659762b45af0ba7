# tinkerflow on GKE: one cluster, a CPU system pool (API, workflow workers, Temporal), an H100 pool and a TPU v6e
# slice pool for the JAX workers, two GCS buckets (checkpoints, claim checks), an Artifact Registry repository and
# Workload Identity bindings. See docs/deploy-gke.md for the whole walk from an empty project.

provider "google" {
  project = var.project_id
  region  = var.region

  default_labels = merge({ app = "tinkerflow", managed-by = "terraform" }, var.labels)
}

data "google_project" "this" {
  project_id = var.project_id
}

locals {
  # Regional cluster by default (control plane in three zones); a zone name makes it zonal.
  location = var.zone != "" ? var.zone : var.region

  workload_pool = "${var.project_id}.svc.id.goog"

  # Bucket names are global: prefix them with the project id unless the caller picks a prefix.
  bucket_prefix = var.bucket_prefix != "" ? var.bucket_prefix : "${var.project_id}-${var.name}"

  registry_path = "${var.region}-docker.pkg.dev/${var.project_id}/${google_artifact_registry_repository.images.repository_id}"

  # TPU v6e: ct6e-standard-4t hosts carry 4 chips each, so a 4x4 slice (16 chips) is 4 hosts.
  tpu_chips = tonumber(split("x", var.tpu_topology)[0]) * tonumber(split("x", var.tpu_topology)[1])
  tpu_hosts = max(1, local.tpu_chips / var.tpu_chips_per_host)
}

resource "google_project_service" "apis" {
  for_each = toset([
    "artifactregistry.googleapis.com",
    "compute.googleapis.com",
    "container.googleapis.com",
    "iam.googleapis.com",
    "iamcredentials.googleapis.com",
    "logging.googleapis.com",
    "monitoring.googleapis.com",
    "storage.googleapis.com",
  ])

  project            = var.project_id
  service            = each.value
  disable_on_destroy = false
}
