terraform {
  required_version = ">= 1.5.0"

  required_providers {
    google = {
      source  = "hashicorp/google"
      version = ">= 6.8.0, < 7.0.0"
    }
  }

  # State holds bucket names and service-account emails, nothing secret; keep it in GCS for a team:
  # terraform init -backend-config="bucket=<state-bucket>" -backend-config="prefix=tinkerflow"
  # backend "gcs" {}
}
