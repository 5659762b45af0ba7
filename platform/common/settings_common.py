"""The settings every process kind reads: where its state lives, how it reaches Temporal and the stores, how it logs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tinkerflow.common.settings_schema import COMMON, parse_path, setting


def _cwd_state_dir() -> Path:
    return (Path.cwd() / ".tinkerflow").resolve()


@dataclass(frozen=True)
class CommonSettings:
    """Settings fields of every process kind (flag group `common`)."""

    # The fields are a table (name, default, help, group): one field per entry, laid out by hand so it reads as one.
    # The RUF009 exemption below: setting() returns a dataclasses.field() (a field specifier), not a shared default.
    # fmt: off
    state_dir: Path = setting(_cwd_state_dir, "directory for the Temporal database, models and the local store",  # noqa: RUF009
                              COMMON, shown="./.tinkerflow", parse=parse_path)
    temporal_address: str = setting("127.0.0.1:7233", "host:port of the Temporal frontend; `up` and `ray` start "
                                    "a dev server unless it is given", COMMON)
    temporal_namespace: str = setting("default", "Temporal namespace", COMMON)
    # mTLS to Temporal Cloud (or any TLS frontend). All empty: plain connection (the dev server).
    temporal_tls_cert: str = setting("", "PEM client certificate for mTLS to Temporal (Temporal Cloud)", COMMON,
                                     shown="none: plain connection")
    temporal_tls_key: str = setting("", "PEM private key of --temporal-tls-cert", COMMON, shown="none")
    temporal_tls_ca: str = setting("", "PEM CA bundle of the Temporal frontend", COMMON, shown="system CAs")
    # Where request bodies and results live while their future is open (docs/architecture.md §The claim-check data
    # path).
    store_url: str = setting("", "claim-check store root: file:///path or gs://bucket/prefix", COMMON,
                             shown="<state-dir>/store")
    # Runs replay request bodies since their last automatic snapshot after a worker dies: keep this well above a
    # step's duration.
    store_retention_s: float = setting(86400.0, "collect claim-check objects older than this many seconds "
                                       "(0: never)", COMMON)
    checkpoint_root: str = setting("", "checkpoint storage root: file:///path or gs://bucket/prefix; every process "
                                   "kind needs the same one", COMMON, shown="<state-dir>/checkpoints")
    # Temporal's sticky cache on the workflow worker. A run evicted from it replays its history and rebuilds its
    # sandbox on its next task, and runs trained round-robin evict one another in LRU order once they outnumber it.
    workflow_cache_size: int = setting(4096, "workflow executions the workflow worker keeps in memory between their "
                                       "tasks (about 0.4 MB each); keep it above the live sessions, training runs and "
                                       "sample batches it serves at once", COMMON)
    log_level: str = setting("INFO", "logging level", COMMON, choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    log_format: str = setting("text", "text for people, json (one object per line) for log pipelines", COMMON,
                              choices=("text", "json"))
    # fmt: on
