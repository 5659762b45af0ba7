"""The settings of the launchers: the Temporal dev server `up`, `temporal` and `ray --with-stack` start, how `up`
supervises its parts, and where `tinkerflow ray` places the JAX worker's actors."""

from __future__ import annotations

from dataclasses import dataclass

from tinkerflow.common.settings_schema import DEV_TEMPORAL, RAY, SUPERVISION, setting


@dataclass(frozen=True)
class LauncherSettings:
    """Settings fields of `up`, `temporal` and `ray` (flag groups `dev-temporal`, `supervision`, `ray`)."""

    # The fields are a table (name, default, help, group): one field per entry, laid out by hand so it reads as one.
    # fmt: off
    # --- the Temporal dev server `up`, `ray --with-stack` and `temporal` start
    temporal_port: int = setting(7233, "frontend port of the dev server", DEV_TEMPORAL)
    ui_port: int = setting(8233, "port of the Temporal Web UI", DEV_TEMPORAL)
    headless: bool = setting(False, "do not serve the Temporal Web UI", DEV_TEMPORAL, shown="off")

    # --- supervision by `tinkerflow up`: backoff doubles from restart_backoff_s up to restart_backoff_max_s; more
    # than crash_loop_restarts restarts of one part within crash_loop_window_s is a crash loop and stops everything.
    restart_backoff_s: float = setting(1.0, "wait this long before restarting a part that exited unexpectedly, "
                                       "doubled for each further restart in the window", SUPERVISION)
    restart_backoff_max_s: float = setting(30.0, "longest wait before a restart", SUPERVISION)
    crash_loop_restarts: int = setting(5, "stop everything when one part needs more than N restarts within "
                                       "--crash-loop-window-s", SUPERVISION)
    crash_loop_window_s: float = setting(300.0, "the crash-loop window in seconds", SUPERVISION)
    up_metrics_port: int = setting(0, "serve `up`'s own Prometheus /metrics (tinkerflow_up_restarts_total by part) "
                                   "on this port", SUPERVISION, shown="0: off")

    # --- `tinkerflow ray` (docs/architecture.md §The processes): one JAX-worker actor per host in a placement group.
    ray_address: str = setting("", "Ray cluster to join, e.g. ray://head:10001 or head:6379", RAY,
                               env_fallbacks=("RAY_ADDRESS",),
                               shown="the cluster of the Ray job this runs in, or $RAY_ADDRESS, or a local "
                               "`ray start`")
    ray_hosts: int = setting(1, "hosts, one JAX process and one placement-group bundle each; above 1 they form one "
                             "jax.distributed group", RAY, aliases=("--hosts",))
    ray_cpus_per_host: float = setting(1.0, "CPUs in each host's bundle", RAY, aliases=("--cpus-per-host",))
    ray_gpus_per_host: float = setting(0.0, "GPUs in each host's bundle", RAY, aliases=("--gpus-per-host",))
    ray_tpus_per_host: float = setting(0.0, "TPU chips in each host's bundle, e.g. 4 on a v6e 4x4 slice's hosts",
                                       RAY, aliases=("--tpus-per-host",))
    ray_strategy: str = setting("STRICT_SPREAD", "placement strategy of the bundles (STRICT_SPREAD: one bundle per "
                                "node, one JAX process per host)", RAY, aliases=("--strategy",),
                                choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    ray_max_restarts: int = setting(10, "times Ray may restart each actor; a fault restarts the whole group "
                                    "(-1: no limit)", RAY, aliases=("--max-restarts",))
    # fmt: on
