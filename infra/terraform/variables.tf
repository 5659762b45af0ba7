# --- Project and location --------------------------------------------------------------------------------------------

variable "project_id" {
  description = "GCP project id that hosts everything (the project must exist and have billing enabled)."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{4,28}[a-z0-9]$", var.project_id))
    error_message = "project_id must be a GCP project id: 6-30 lowercase letters, digits or hyphens, starting with a letter."
  }
}

variable "region" {
  description = "Region for the cluster, buckets and Artifact Registry. Pick one with both a3-highgpu (H100) and TPU v6e capacity if you want both pools (us-east5 and europe-west4 at the time of writing)."
  type        = string
  default     = "us-east5"

  validation {
    condition     = can(regex("^[a-z]+-[a-z]+[0-9]+$", var.region))
    error_message = "region must look like a GCP region, e.g. us-east5."
  }
}

variable "zone" {
  description = "Empty for a regional cluster (control plane replicated across the region's zones); a zone name (e.g. us-east5-a) for a cheaper zonal cluster."
  type        = string
  default     = ""

  validation {
    condition     = var.zone == "" || can(regex("^[a-z]+-[a-z]+[0-9]+-[a-z]$", var.zone))
    error_message = "zone must be empty or a GCP zone, e.g. us-east5-a."
  }
}

variable "name" {
  description = "Name of the cluster and prefix of the other resources."
  type        = string
  default     = "tinkerflow"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,17}[a-z0-9]$", var.name))
    error_message = "name must be 3-19 lowercase letters, digits or hyphens, starting with a letter (service account ids add up to 11 characters and must stay within 30)."
  }
}

variable "labels" {
  description = "Extra labels put on every resource that takes labels."
  type        = map(string)
  default     = {}

  validation {
    condition     = alltrue([for k, v in var.labels : can(regex("^[a-z][a-z0-9_-]{0,62}$", k)) && can(regex("^[a-z0-9_-]{0,63}$", v))])
    error_message = "labels keys/values must be lowercase GCP labels (keys start with a letter, at most 63 chars)."
  }
}

# --- Network ---------------------------------------------------------------------------------------------------------

variable "subnet_cidr" {
  description = "Primary range of the node subnet."
  type        = string
  default     = "10.10.0.0/20"

  validation {
    condition     = can(cidrhost(var.subnet_cidr, 0))
    error_message = "subnet_cidr must be a CIDR block."
  }
}

variable "pods_cidr" {
  description = "Secondary range for pod IPs."
  type        = string
  default     = "10.20.0.0/14"

  validation {
    condition     = can(cidrhost(var.pods_cidr, 0))
    error_message = "pods_cidr must be a CIDR block."
  }
}

variable "services_cidr" {
  description = "Secondary range for Service IPs."
  type        = string
  default     = "10.30.0.0/20"

  validation {
    condition     = can(cidrhost(var.services_cidr, 0))
    error_message = "services_cidr must be a CIDR block."
  }
}

variable "private_nodes" {
  description = "Give nodes no external IPs (egress through Cloud NAT). The control-plane endpoint stays public, limited by master_authorized_networks."
  type        = bool
  default     = true
}

variable "master_ipv4_cidr" {
  description = "The /28 the GKE control plane uses when private_nodes is true."
  type        = string
  default     = "172.16.0.0/28"

  validation {
    condition     = can(cidrhost(var.master_ipv4_cidr, 0)) && endswith(var.master_ipv4_cidr, "/28")
    error_message = "master_ipv4_cidr must be a /28 CIDR block."
  }
}

variable "master_authorized_networks" {
  description = "CIDR blocks allowed to reach the Kubernetes API (e.g. your workstation's /32). Empty: no restriction."
  type = list(object({
    cidr_block   = string
    display_name = string
  }))
  default = []

  validation {
    condition     = alltrue([for n in var.master_authorized_networks : can(cidrhost(n.cidr_block, 0))])
    error_message = "every master_authorized_networks entry needs a valid cidr_block."
  }
}

# --- Cluster ---------------------------------------------------------------------------------------------------------

variable "release_channel" {
  description = "GKE release channel. RAPID has the newest TPU/GPU features first; REGULAR is the sensible default."
  type        = string
  default     = "REGULAR"

  validation {
    condition     = contains(["RAPID", "REGULAR", "STABLE"], var.release_channel)
    error_message = "release_channel must be RAPID, REGULAR or STABLE."
  }
}

variable "deletion_protection" {
  description = "Refuse `terraform destroy` of the cluster. Set false for throw-away clusters."
  type        = bool
  default     = true
}

variable "binary_authorization" {
  description = "Enforce the project's Binary Authorization policy on the cluster (configure the policy separately)."
  type        = bool
  default     = false
}

variable "system_machine_type" {
  description = "Machine type of the CPU system pool (API, workflow workers, Temporal)."
  type        = string
  default     = "n2-standard-8"

  validation {
    condition     = can(regex("^[a-z0-9]+-[a-z]+-[0-9]+$", var.system_machine_type))
    error_message = "system_machine_type must be a GCE machine type, e.g. n2-standard-8."
  }
}

variable "system_min_nodes" {
  description = "Minimum nodes of the CPU system pool (across its zones)."
  type        = number
  default     = 1

  validation {
    condition     = var.system_min_nodes >= 1 && floor(var.system_min_nodes) == var.system_min_nodes
    error_message = "system_min_nodes must be a whole number >= 1 (the API and Temporal must run somewhere)."
  }
}

variable "system_max_nodes" {
  description = "Maximum nodes of the CPU system pool (across its zones)."
  type        = number
  default     = 6

  validation {
    condition     = var.system_max_nodes >= 1 && var.system_max_nodes <= 100 && floor(var.system_max_nodes) == var.system_max_nodes
    error_message = "system_max_nodes must be a whole number between 1 and 100."
  }
}

# --- H100 pool -------------------------------------------------------------------------------------------------------

variable "enable_gpu_pool" {
  description = "Create the H100 (a3-highgpu) node pool."
  type        = bool
  default     = true
}

variable "gpu_machine_type" {
  description = "A3 machine type of the H100 pool (a3-highgpu-8g: 8 GPUs per host; smaller shapes need flex-start/spot)."
  type        = string
  default     = "a3-highgpu-8g"

  validation {
    condition     = contains(["a3-highgpu-1g", "a3-highgpu-2g", "a3-highgpu-4g", "a3-highgpu-8g"], var.gpu_machine_type)
    error_message = "gpu_machine_type must be one of a3-highgpu-{1,2,4,8}g."
  }
}

variable "gpu_count_per_node" {
  description = "H100 GPUs attached per host; must match gpu_machine_type (a3-highgpu-Ng has N)."
  type        = number
  default     = 8

  validation {
    condition     = contains([1, 2, 4, 8], var.gpu_count_per_node)
    error_message = "gpu_count_per_node must be 1, 2, 4 or 8."
  }
}

variable "gpu_local_ssd_count" {
  description = "Local NVMe SSDs used as ephemeral storage on H100 hosts (a3-highgpu-8g has 16; -1g/-2g/-4g have 2/4/8)."
  type        = number
  default     = 16

  validation {
    condition     = contains([2, 4, 8, 16], var.gpu_local_ssd_count)
    error_message = "gpu_local_ssd_count must be 2, 4, 8 or 16."
  }
}

variable "gpu_zones" {
  description = "Zones (in region) for the H100 pool; must have a3-highgpu capacity."
  type        = list(string)
  default     = ["us-east5-a"]

  validation {
    condition     = length(var.gpu_zones) > 0 && alltrue([for z in var.gpu_zones : can(regex("^[a-z]+-[a-z]+[0-9]+-[a-z]$", z))])
    error_message = "gpu_zones must be a non-empty list of zones, e.g. [\"us-east5-a\"]."
  }
}

variable "gpu_max_nodes" {
  description = "Maximum H100 hosts the autoscaler may create (the pool scales to zero when idle)."
  type        = number
  default     = 2

  validation {
    condition     = var.gpu_max_nodes >= 1 && var.gpu_max_nodes <= 64 && floor(var.gpu_max_nodes) == var.gpu_max_nodes
    error_message = "gpu_max_nodes must be a whole number between 1 and 64."
  }
}

variable "gpu_spot" {
  description = "Use Spot VMs for the H100 pool (cheaper, preemptible; a preempted JAX worker is noticed and its adapters re-placed)."
  type        = bool
  default     = false
}

# --- TPU pool --------------------------------------------------------------------------------------------------------

variable "enable_tpu_pool" {
  description = "Create the TPU v6e slice node pool."
  type        = bool
  default     = true
}

variable "tpu_machine_type" {
  description = "TPU v6e host machine type; multi-host slices use ct6e-standard-4t (4 chips per host)."
  type        = string
  default     = "ct6e-standard-4t"

  validation {
    condition     = contains(["ct6e-standard-1t", "ct6e-standard-4t", "ct6e-standard-8t"], var.tpu_machine_type)
    error_message = "tpu_machine_type must be ct6e-standard-1t, -4t or -8t."
  }
}

variable "tpu_chips_per_host" {
  description = "TPU chips per host of tpu_machine_type (4 for ct6e-standard-4t)."
  type        = number
  default     = 4

  validation {
    condition     = contains([1, 4, 8], var.tpu_chips_per_host)
    error_message = "tpu_chips_per_host must be 1, 4 or 8."
  }
}

variable "tpu_topology" {
  description = "TPU v6e slice topology (chips AxB). 4x4 = 16 chips on 4 hosts."
  type        = string
  default     = "4x4"

  validation {
    condition     = contains(["2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"], var.tpu_topology)
    error_message = "tpu_topology must be a v6e topology: 2x2, 2x4, 4x4, 4x8, 8x8, 8x16 or 16x16."
  }
}

variable "tpu_zones" {
  description = "Zone (in region) for the TPU slice; must have v6e capacity. A slice lives in exactly one zone."
  type        = list(string)
  default     = ["us-east5-b"]

  validation {
    condition     = length(var.tpu_zones) == 1 && can(regex("^[a-z]+-[a-z]+[0-9]+-[a-z]$", var.tpu_zones[0]))
    error_message = "tpu_zones must hold exactly one zone, e.g. [\"us-east5-b\"]."
  }
}

variable "tpu_spot" {
  description = "Use Spot VMs for the TPU slice."
  type        = bool
  default     = false
}

# --- Storage ---------------------------------------------------------------------------------------------------------

variable "bucket_prefix" {
  description = "Prefix of the bucket names (<prefix>-checkpoints, <prefix>-claim-checks). Empty: <project_id>-<name>."
  type        = string
  default     = ""

  validation {
    condition     = var.bucket_prefix == "" || can(regex("^[a-z0-9][a-z0-9-]{1,48}[a-z0-9]$", var.bucket_prefix))
    error_message = "bucket_prefix must be empty or 3-50 lowercase letters, digits or hyphens."
  }
}

variable "claim_check_retention_days" {
  description = "Claim-check objects (request bodies, results) are deleted this many days after they were written. They are only needed while their future is open, so a day or two is plenty."
  type        = number
  default     = 2

  validation {
    condition     = var.claim_check_retention_days >= 1 && var.claim_check_retention_days <= 30 && floor(var.claim_check_retention_days) == var.claim_check_retention_days
    error_message = "claim_check_retention_days must be a whole number between 1 and 30."
  }
}

variable "checkpoint_noncurrent_retention_days" {
  description = "Overwritten or deleted checkpoint object versions are kept this many days (undo window)."
  type        = number
  default     = 14

  validation {
    condition     = var.checkpoint_noncurrent_retention_days >= 1 && var.checkpoint_noncurrent_retention_days <= 365
    error_message = "checkpoint_noncurrent_retention_days must be between 1 and 365."
  }
}

variable "force_destroy_buckets" {
  description = "Let `terraform destroy` delete non-empty buckets (checkpoints included). Keep false outside experiments."
  type        = bool
  default     = false
}

# --- Kubernetes side (must match infra/k8s) --------------------------------------------------------------------------

variable "k8s_namespace" {
  description = "Kubernetes namespace the tinkerflow manifests are applied to (infra/k8s/base/kustomization.yaml)."
  type        = string
  default     = "tinkerflow"

  validation {
    condition     = can(regex("^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$", var.k8s_namespace))
    error_message = "k8s_namespace must be a DNS-1123 label."
  }
}

variable "image_tag" {
  description = "Tag of the tinkerflow image the generated site kustomization points at."
  type        = string
  default     = "latest"

  validation {
    condition     = can(regex("^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$", var.image_tag))
    error_message = "image_tag must be a valid Docker tag."
  }
}

variable "k8s_overlay" {
  description = "Which infra/k8s overlay the generated site kustomization builds on: cpu, gpu or tpu."
  type        = string
  default     = "gpu"

  validation {
    condition     = contains(["cpu", "gpu", "tpu"], var.k8s_overlay)
    error_message = "k8s_overlay must be cpu, gpu or tpu."
  }
}
