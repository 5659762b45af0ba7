resource "google_artifact_registry_repository" "images" {
  location      = var.region
  repository_id = var.name
  description   = "tinkerflow container images (CPU, CUDA and TPU variants of infra/docker/Dockerfile)"
  format        = "DOCKER"

  docker_config {
    immutable_tags = false
  }

  # Keep the 20 newest versions of every image; drop untagged layers after a week.
  cleanup_policies {
    id     = "keep-recent"
    action = "KEEP"
    most_recent_versions {
      keep_count = 20
    }
  }

  cleanup_policies {
    id     = "delete-untagged"
    action = "DELETE"
    condition {
      tag_state  = "UNTAGGED"
      older_than = "604800s"
    }
  }

  depends_on = [google_project_service.apis]
}
