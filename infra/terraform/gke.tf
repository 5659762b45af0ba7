resource "google_container_cluster" "this" {
  provider = google

  name     = var.name
  location = local.location

  # Node pools are managed below; the default pool is created and removed at once.
  remove_default_node_pool = true
  initial_node_count       = 1

  network         = google_compute_network.vpc.id
  subnetwork      = google_compute_subnetwork.nodes.id
  networking_mode = "VPC_NATIVE"

  ip_allocation_policy {
    cluster_secondary_range_name  = "pods"
    services_secondary_range_name = "services"
  }

  release_channel {
    channel = var.release_channel
  }

  # Pods get Google credentials only through their Kubernetes service account (iam.tf), never the node's.
  workload_identity_config {
    workload_pool = local.workload_pool
  }

  # Dataplane V2 enforces NetworkPolicy (infra/k8s/base/networkpolicy.yaml).
  datapath_provider = "ADVANCED_DATAPATH"

  dynamic "private_cluster_config" {
    for_each = var.private_nodes ? [1] : []
    content {
      enable_private_nodes    = true
      enable_private_endpoint = false
      master_ipv4_cidr_block  = var.master_ipv4_cidr
    }
  }

  # Who may reach the Kubernetes API. Empty means no restriction (the control plane is still authenticated);
  # set it to your office/VPN ranges for anything but a throw-away cluster.
  dynamic "master_authorized_networks_config" {
    for_each = length(var.master_authorized_networks) > 0 ? [1] : []
    content {
      dynamic "cidr_blocks" {
        for_each = var.master_authorized_networks
        content {
          cidr_block   = cidr_blocks.value.cidr_block
          display_name = cidr_blocks.value.display_name
        }
      }
    }
  }

  addons_config {
    # Read-only model weights (HF cache) mounted from GCS on the JAX workers (docs/deploy-gke.md).
    gcs_fuse_csi_driver_config {
      enabled = true
    }
    http_load_balancing {
      disabled = false
    }
    horizontal_pod_autoscaling {
      disabled = false
    }
  }

  # No legacy client certificates: kubectl authenticates with Google credentials only.
  master_auth {
    client_certificate_config {
      issue_client_certificate = false
    }
  }

  enable_shielded_nodes       = true
  enable_intranode_visibility = true

  binary_authorization {
    evaluation_mode = var.binary_authorization ? "PROJECT_SINGLETON_POLICY_ENFORCE" : "DISABLED"
  }

  security_posture_config {
    mode               = "BASIC"
    vulnerability_mode = "VULNERABILITY_BASIC"
  }

  logging_config {
    enable_components = ["SYSTEM_COMPONENTS", "WORKLOADS"]
  }

  monitoring_config {
    enable_components = ["SYSTEM_COMPONENTS"]
    managed_prometheus {
      enabled = true
    }
  }

  resource_labels = merge({ app = "tinkerflow" }, var.labels)

  deletion_protection = var.deletion_protection

  depends_on = [google_project_service.apis]
}

# --- CPU system pool: the API, workflow workers, Temporal (Helm) and kube-system. -----------------------------------
resource "google_container_node_pool" "system" {
  name     = "system"
  cluster  = google_container_cluster.this.id
  location = local.location

  autoscaling {
    total_min_node_count = var.system_min_nodes
    total_max_node_count = var.system_max_nodes
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  node_config {
    machine_type    = var.system_machine_type
    disk_size_gb    = 100
    disk_type       = "pd-balanced"
    image_type      = "COS_CONTAINERD"
    service_account = google_service_account.nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    labels          = { "tinkerflow.dev/pool" = "system" }

    workload_metadata_config {
      mode = "GKE_METADATA"
    }

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }

    metadata = {
      disable-legacy-endpoints = "true"
    }
  }
}

# --- H100 pool: a3-highgpu-8g hosts (8x H100 80GB), one JAX worker process per host. -------------------------------
resource "google_container_node_pool" "gpu" {
  count = var.enable_gpu_pool ? 1 : 0

  name           = "h100"
  cluster        = google_container_cluster.this.id
  location       = local.location
  node_locations = var.gpu_zones

  # Scale from zero: H100 hosts cost money only while a JAX worker JobSet asks for them.
  autoscaling {
    total_min_node_count = 0
    total_max_node_count = var.gpu_max_nodes
    location_policy      = "ANY"
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  node_config {
    machine_type    = var.gpu_machine_type
    image_type      = "COS_CONTAINERD"
    disk_type       = "pd-ssd"
    disk_size_gb    = 200
    spot            = var.gpu_spot
    service_account = google_service_account.nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    labels          = { "tinkerflow.dev/pool" = "h100" }

    guest_accelerator {
      type  = "nvidia-h100-80gb"
      count = var.gpu_count_per_node

      # GKE installs the driver; the image brings CUDA user space as jax[cuda12] wheels.
      gpu_driver_installation_config {
        gpu_driver_version = "LATEST"
      }
    }

    # a3-highgpu-8g comes with 16 local NVMe SSDs; use them for ephemeral storage (XLA caches, emptyDirs).
    ephemeral_storage_local_ssd_config {
      local_ssd_count = var.gpu_local_ssd_count
    }

    # A3 needs gVNIC.
    gvnic {
      enabled = true
    }

    # Only pods that tolerate the GPU taint land here (GKE also adds it; explicit so the intent is visible).
    taint {
      key    = "nvidia.com/gpu"
      value  = "present"
      effect = "NO_SCHEDULE"
    }

    workload_metadata_config {
      mode = "GKE_METADATA"
    }

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }

    metadata = {
      disable-legacy-endpoints = "true"
    }
  }
}

# --- TPU v6e slice pool: one multi-host slice (4x4 = 16 chips on 4 ct6e-standard-4t hosts). ------------------------
resource "google_container_node_pool" "tpu" {
  count = var.enable_tpu_pool ? 1 : 0

  name           = "tpu-v6e-${var.tpu_topology}"
  cluster        = google_container_cluster.this.id
  location       = local.location
  node_locations = var.tpu_zones

  # A multi-host slice is atomic: all its hosts exist together, so the pool has exactly that many nodes.
  node_count = local.tpu_hosts

  # COMPACT placement with the topology makes GKE provision the hosts as one ICI-connected slice.
  placement_policy {
    type         = "COMPACT"
    tpu_topology = var.tpu_topology
  }

  management {
    auto_repair  = true
    auto_upgrade = true
  }

  node_config {
    machine_type    = var.tpu_machine_type
    image_type      = "COS_CONTAINERD"
    disk_type       = "pd-balanced"
    disk_size_gb    = 200
    spot            = var.tpu_spot
    service_account = google_service_account.nodes.email
    oauth_scopes    = ["https://www.googleapis.com/auth/cloud-platform"]
    labels          = { "tinkerflow.dev/pool" = "tpu-v6e" }

    taint {
      key    = "google.com/tpu"
      value  = "present"
      effect = "NO_SCHEDULE"
    }

    workload_metadata_config {
      mode = "GKE_METADATA"
    }

    shielded_instance_config {
      enable_secure_boot          = true
      enable_integrity_monitoring = true
    }

    metadata = {
      disable-legacy-endpoints = "true"
    }
  }
}
