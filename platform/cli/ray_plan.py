"""What `tinkerflow ray` asks of Ray, computed from the Settings alone (no Ray here, so it is tested without one):
the placement group's bundles, each actor's resources and environment, and each process's place in the
jax.distributed group."""

from __future__ import annotations

import dataclasses
import os

from tinkerflow.common.settings import Settings

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    hosts: int
    bundle: dict[str, float]  # the resources of one host's bundle, the same for every host
    strategy: str
    max_restarts: int
    mesh_fsdp: int
    mesh_tp: int
    pool: str

    @property
    def bundles(self) -> list[dict[str, float]]:
        return [dict(self.bundle) for _ in range(self.hosts)]

    @property
    def worker_id(self) -> str:
        """Process 0's worker id: the same across every re-forming of the group, so the coordinator sees the
        worker come back (new incarnation) rather than a stranger, and restores its runs through the usual path."""
        return f"ray-{self.pool}"

    def actor_options(self) -> dict:
        """Resources of one actor: all of its bundle (it is the host's one JAX process)."""
        extra = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        return {
            "num_cpus": self.bundle.get("CPU", 0),
            "num_gpus": self.bundle.get("GPU", 0),
            "resources": extra,
            "max_restarts": self.max_restarts,
            "max_concurrency": 4,
        }


def plan(settings: Settings) -> GroupPlan:
    """The group the settings ask for, or a ValueError that names the flag at fault."""
    if settings.ray_hosts < 1:
        raise ValueError(f"--hosts must be >= 1, got {settings.ray_hosts}")
    strategy = settings.ray_strategy.upper()
    if strategy not in STRATEGIES:
        raise ValueError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {settings.ray_strategy!r}")
    for flag, value in (
        ("--cpus-per-host", settings.ray_cpus_per_host),
        ("--gpus-per-host", settings.ray_gpus_per_host),
        ("--tpus-per-host", settings.ray_tpus_per_host),
    ):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0, got {value}")
    if settings.ray_gpus_per_host and settings.ray_tpus_per_host:
        raise ValueError("a host has GPUs or TPUs, not both: give --gpus-per-host or --tpus-per-host")
    if settings.ray_max_restarts < -1:
        raise ValueError(f"--max-restarts must be >= -1 (-1: no limit), got {settings.ray_max_restarts}")
    bundle = {"CPU": settings.ray_cpus_per_host}
    if settings.ray_gpus_per_host:
        bundle["GPU"] = settings.ray_gpus_per_host
    if settings.ray_tpus_per_host:
        bundle["TPU"] = settings.ray_tpus_per_host
    return GroupPlan(
        hosts=settings.ray_hosts,
        bundle=bundle,
        strategy=strategy,
        max_restarts=settings.ray_max_restarts,
        mesh_fsdp=settings.mesh_fsdp,
        mesh_tp=settings.mesh_tp,
        pool=settings.pool,
    )


def actor_env(settings: Settings, group: GroupPlan) -> dict[str, str]:
    """Environment of every actor process, set before it imports JAX."""
    env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"), "PYTHONUNBUFFERED": "1"}
    if not group.bundle.get("GPU") and not group.bundle.get("TPU"):
        env["JAX_PLATFORMS"] = "cpu"  # one CPU device per process, as the multi-host worker's CPU tests run
    return env


def process_settings(settings: Settings, group: GroupPlan, index: int, coordinator_address: str) -> Settings:
    """Process `index`'s settings: its place in the jax.distributed group (process id = bundle index) and the
    resolved store and checkpoint roots (a host other than the driver's has no <state-dir> of the driver)."""
    multi = group.hosts > 1
    return dataclasses.replace(
        settings,
        store_url=settings.resolved_store_url,
        checkpoint_root=settings.resolved_checkpoint_root,
        coordinator_address=coordinator_address if multi else "",
        num_processes=group.hosts,
        process_id=index,
        mesh_fsdp=group.mesh_fsdp,
        mesh_tp=group.mesh_tp,
        metrics_port=settings.metrics_port if index == 0 else 0,
    )
