# Two buckets with different lives:
#  - checkpoints: training state, sampler weights, and the pre-staged HF model cache under hf-cache/ (read-only
#    GCS FUSE mount on the JAX workers). Versioned, kept until deleted.
#  - claim checks: request bodies and results while their future is open (docs/architecture.md §The claim-check
#    data path). Short-lived by design, so a lifecycle rule deletes them after claim_check_retention_days whatever
#    the app's own GC did.

resource "google_storage_bucket" "checkpoints" {
  name          = "${local.bucket_prefix}-checkpoints"
  location      = var.region
  storage_class = "STANDARD"
  force_destroy = var.force_destroy_buckets

  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  versioning {
    enabled = true
  }

  # Superseded checkpoint versions go after the undo window.
  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.checkpoint_noncurrent_retention_days
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  lifecycle_rule {
    condition {
      age = 7
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }

  soft_delete_policy {
    retention_duration_seconds = 7 * 24 * 3600
  }

  depends_on = [google_project_service.apis]
}

resource "google_storage_bucket" "claim_checks" {
  name          = "${local.bucket_prefix}-claim-checks"
  location      = var.region
  storage_class = "STANDARD"
  # Nothing in here outlives a future; destroying the stack must not be blocked by leftovers.
  force_destroy = true

  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"

  # No versioning: objects are written once and read once; old versions would only cost money.
  versioning {
    enabled = false
  }

  lifecycle_rule {
    condition {
      age = var.claim_check_retention_days
    }
    action {
      type = "Delete"
    }
  }

  lifecycle_rule {
    condition {
      age = 1
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }

  # Soft delete would keep every short-lived payload for 7 more days; turn it off.
  soft_delete_policy {
    retention_duration_seconds = 0
  }

  depends_on = [google_project_service.apis]
}
