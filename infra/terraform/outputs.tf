output "project_id" {
  description = "Project everything lives in."
  value       = var.project_id
}

output "cluster_name" {
  description = "GKE cluster name (gcloud container clusters get-credentials <name> --location <location>)."
  value       = google_container_cluster.this.name
}

output "cluster_location" {
  description = "Region (regional cluster) or zone (zonal cluster) of the GKE cluster."
  value       = google_container_cluster.this.location
}

output "get_credentials_command" {
  description = "Command that points kubectl at the cluster."
  value       = "gcloud container clusters get-credentials ${google_container_cluster.this.name} --location ${google_container_cluster.this.location} --project ${var.project_id}"
}

output "registry_path" {
  description = "Artifact Registry path to push images to: <registry_path>/tinkerflow:<tag>."
  value       = local.registry_path
}

output "image" {
  description = "Image name (without tag) the manifests use."
  value       = "${local.registry_path}/tinkerflow"
}

output "checkpoints_bucket" {
  description = "Name of the checkpoints bucket (also holds the pre-staged HF cache under hf-cache/)."
  value       = google_storage_bucket.checkpoints.name
}

output "checkpoints_bucket_url" {
  description = "gs:// URL of the checkpoints bucket."
  value       = google_storage_bucket.checkpoints.url
}

output "claim_checks_bucket" {
  description = "Name of the claim-check bucket."
  value       = google_storage_bucket.claim_checks.name
}

output "claim_checks_bucket_url" {
  description = "gs:// URL of the claim-check bucket."
  value       = google_storage_bucket.claim_checks.url
}

output "store_url" {
  description = "Value for TINKERFLOW_STORE_URL."
  value       = "${google_storage_bucket.claim_checks.url}/store"
}

output "checkpoint_root" {
  description = "Value for TINKERFLOW_CHECKPOINT_ROOT."
  value       = "${google_storage_bucket.checkpoints.url}/checkpoints"
}

output "api_service_account_email" {
  description = "Google service account of the API pods (annotate KSA tinkerflow-api with it)."
  value       = google_service_account.app["api"].email
}

output "jax_worker_service_account_email" {
  description = "Google service account of the JAX worker pods (annotate KSA tinkerflow-jax-worker with it)."
  value       = google_service_account.app["jax-worker"].email
}

output "node_service_account_email" {
  description = "Google service account of the node VMs."
  value       = google_service_account.nodes.email
}

output "k8s_namespace" {
  description = "Namespace the Workload Identity bindings were made for."
  value       = var.k8s_namespace
}

# A kustomization for infra/k8s/site/ (untracked) that puts this project's values into the chosen overlay:
#   mkdir -p infra/k8s/site && terraform -chdir=infra/terraform output -raw site_kustomization > infra/k8s/site/kustomization.yaml
output "site_kustomization" {
  description = "kustomization.yaml for infra/k8s/site/: the chosen overlay with this project's image, buckets and service accounts."
  value = yamlencode({
    apiVersion = "kustomize.config.k8s.io/v1beta1"
    kind       = "Kustomization"
    resources  = ["../${var.k8s_overlay}"]
    images = [
      { name = "tinkerflow", newName = "${local.registry_path}/tinkerflow", newTag = "${var.image_tag}-cpu" },
      {
        name    = "tinkerflow-jax"
        newName = "${local.registry_path}/tinkerflow"
        newTag  = "${var.image_tag}-${lookup({ cpu = "cpu", gpu = "cuda", tpu = "tpu" }, var.k8s_overlay)}"
      },
    ]
    # API keys and the replicas' shared signing key come from api-keys.env next to this file
    # (TINKERFLOW_API_KEYS=tml-..., TINKERFLOW_URL_SIGNING_KEY=...); never commit it.
    secretGenerator = [{
      name      = "tinkerflow-api-keys"
      namespace = var.k8s_namespace
      behavior  = "replace"
      envs      = ["api-keys.env"]
      options   = { disableNameSuffixHash = true }
    }]
    patches = concat(
      [
        for role, acct in local.app_accounts : {
          target = { kind = "ServiceAccount", name = acct.ksa }
          patch = yamlencode([{
            op    = "add"
            path  = "/metadata/annotations/iam.gke.io~1gcp-service-account"
            value = google_service_account.app[role].email
          }])
        }
      ],
      [{
        target = { kind = "ConfigMap", name = "tinkerflow-config" }
        patch = yamlencode([{
          op    = "replace"
          path  = "/data/TINKERFLOW_STORE_URL"
          value = "${google_storage_bucket.claim_checks.url}/store"
          }, {
          op    = "replace"
          path  = "/data/TINKERFLOW_CHECKPOINT_ROOT"
          value = "${google_storage_bucket.checkpoints.url}/checkpoints"
        }])
      }],
      # The cpu overlay's ReadWriteOnce store volume is for one-node dev clusters; with the store in GCS it is not
      # mounted, so API and JAX pods may land on different nodes.
      var.k8s_overlay != "cpu" ? [] : [
        {
          target = { kind = "Deployment", name = "tinkerflow-api" }
          patch = yamlencode([
            { op = "test", path = "/spec/template/spec/volumes/2/name", value = "store" },
            { op = "remove", path = "/spec/template/spec/volumes/2" },
            { op = "test", path = "/spec/template/spec/containers/0/volumeMounts/2/name", value = "store" },
            { op = "remove", path = "/spec/template/spec/containers/0/volumeMounts/2" },
          ])
        },
        {
          target = { kind = "JobSet", name = "tinkerflow-jax" }
          patch = yamlencode([
            { op = "test", path = "/spec/replicatedJobs/0/template/spec/template/spec/volumes/3/name", value = "store" },
            { op = "remove", path = "/spec/replicatedJobs/0/template/spec/template/spec/volumes/3" },
            { op = "test", path = "/spec/replicatedJobs/0/template/spec/template/spec/containers/0/volumeMounts/3/name", value = "store" },
            { op = "remove", path = "/spec/replicatedJobs/0/template/spec/template/spec/containers/0/volumeMounts/3" },
          ])
        },
      ],
      var.k8s_overlay == "cpu" ? [] : [{
        target = { kind = "JobSet", name = "tinkerflow-jax" }
        patch = yamlencode([{
          op    = "replace"
          path  = "/spec/replicatedJobs/0/template/spec/template/spec/volumes/2/csi/volumeAttributes/bucketName"
          value = google_storage_bucket.checkpoints.name
        }])
      }],
    )
  })
}
