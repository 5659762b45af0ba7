"""Settings shared by every process kind, from flags and `TINKERFLOW_*` environment variables.

One frozen dataclass so a process's whole configuration is visible in one place and can be logged at start-up.
Flags win over the environment, the environment wins over the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

ENV_PREFIX = "TINKERFLOW_"


def _env(name: str, default: str) -> str:
    return os.environ.get(ENV_PREFIX + name, default)


def default_state_dir() -> Path:
    return Path(_env("STATE_DIR", str(Path.cwd() / ".tinkerflow"))).expanduser().resolve()


@dataclass(frozen=True)
class Settings:
    state_dir: Path = field(default_factory=default_state_dir)
    temporal_address: str = field(default_factory=lambda: _env("TEMPORAL_ADDRESS", "127.0.0.1:7233"))
    temporal_namespace: str = field(default_factory=lambda: _env("TEMPORAL_NAMESPACE", "default"))
    # mTLS to Temporal Cloud (or any TLS frontend): PEM files of the client certificate and key; a CA bundle only
    # for a server whose certificate a system CA does not sign. All empty: plain connection (the dev server).
    temporal_tls_cert: str = field(default_factory=lambda: _env("TEMPORAL_TLS_CERT", ""))
    temporal_tls_key: str = field(default_factory=lambda: _env("TEMPORAL_TLS_KEY", ""))
    temporal_tls_ca: str = field(default_factory=lambda: _env("TEMPORAL_TLS_CA", ""))
    # Where request bodies and results live while their future is open (DESIGN §3). file:// or gs://.
    store_url: str = field(default_factory=lambda: _env("STORE_URL", ""))
    host: str = field(default_factory=lambda: _env("HOST", "127.0.0.1"))
    port: int = field(default_factory=lambda: int(_env("PORT", "8000")))
    base_model: str = field(default_factory=lambda: _env("BASE_MODEL", ""))
    # The name the base model is served under (vLLM's --served-model-name); empty: the HF id or directory path.
    served_model_name: str = field(default_factory=lambda: _env("SERVED_MODEL_NAME", ""))
    pool: str = field(default_factory=lambda: _env("POOL", "default"))
    max_lora_adapters: int = field(default_factory=lambda: int(_env("MAX_LORA_ADAPTERS", "8")))
    max_lora_rank: int = field(default_factory=lambda: int(_env("MAX_LORA_RANK", "32")))
    # Comma-separated; empty means the API is open (with a warning at start-up).
    api_keys: tuple[str, ...] = field(
        default_factory=lambda: tuple(k for k in _env("API_KEYS", "").split(",") if k.strip())
    )
    # One key per line ('#' comments allowed); merged with api_keys. Read once when the API starts.
    api_keys_file: str = field(default_factory=lambda: _env("API_KEYS_FILE", ""))
    session_timeout_s: float = field(default_factory=lambda: float(_env("SESSION_TIMEOUT_S", "120")))
    # asample answers 429 (the SDK backs off and resubmits) while this many samples wait in a coordinator's queue.
    max_queued_samples: int = field(default_factory=lambda: int(_env("MAX_QUEUED_SAMPLES", "1024")))
    # ... or while this many tokens of sampling work (samples x (prompt + max_tokens)) wait: queues count work.
    max_queued_sample_tokens: int = field(default_factory=lambda: int(_env("MAX_QUEUED_SAMPLE_TOKENS",
                                                                            str(1 << 20))))
    # Bodies larger than this (on the wire, and after zstd decompression) are refused with HTTP 413.
    max_request_bytes: int = field(default_factory=lambda: int(_env("MAX_REQUEST_BYTES", str(256 * 1024 * 1024))))
    # Body limits of the routes that carry less than forward_backward (see api/body_limits.py): asample (a prompt)
    # and every control route (a few fields and at most 16 KiB of user_metadata).
    max_sample_body_bytes: int = field(default_factory=lambda: int(_env("MAX_SAMPLE_BODY_BYTES", str(16 << 20))))
    max_control_body_bytes: int = field(default_factory=lambda: int(_env("MAX_CONTROL_BODY_BYTES", str(1 << 20))))
    # Per-request caps: one call may not ask for more than this (HTTP 400 for asample; a failed future for the
    # in-sequence forward_backward, whose seq_id must still be consumed).
    max_samples_per_request: int = field(default_factory=lambda: int(_env("MAX_SAMPLES_PER_REQUEST", "128")))
    max_sample_tokens: int = field(default_factory=lambda: int(_env("MAX_SAMPLE_TOKENS", "8192")))
    max_datums_per_request: int = field(default_factory=lambda: int(_env("MAX_DATUMS_PER_REQUEST", "4096")))
    # How long retrieve_future holds a poll before answering try_again (the SDK times out at 45 s).
    long_poll_s: float = field(default_factory=lambda: float(_env("LONG_POLL_S", "25")))
    log_level: str = field(default_factory=lambda: _env("LOG_LEVEL", "INFO"))
    log_format: str = field(default_factory=lambda: _env("LOG_FORMAT", "text"))  # text | json
    # Port of the JAX worker's Prometheus /metrics (0: off). The API serves /metrics on its own port.
    metrics_port: int = field(default_factory=lambda: int(_env("METRICS_PORT", "0")))

    # Sampler snapshots a JAX worker keeps in device memory, in MiB (least recently used evicted first; saved
    # weights reload on demand, an evicted ephemeral snapshot fails its sample clearly). 0: a tenth of the device's.
    snapshot_budget_mb: int = field(default_factory=lambda: int(_env("SNAPSHOT_BUDGET_MB", "0")))
    # Supervision by `tinkerflow up`: a part that exits unexpectedly is started again after a backoff that doubles
    # from restart_backoff_s up to restart_backoff_max_s; more than crash_loop_restarts restarts of one part within
    # crash_loop_window_s seconds is a crash loop, and `up` stops everything and says which part and where its log is.
    restart_backoff_s: float = field(default_factory=lambda: float(_env("RESTART_BACKOFF_S", "1")))
    restart_backoff_max_s: float = field(default_factory=lambda: float(_env("RESTART_BACKOFF_MAX_S", "30")))
    crash_loop_restarts: int = field(default_factory=lambda: int(_env("CRASH_LOOP_RESTARTS", "5")))
    crash_loop_window_s: float = field(default_factory=lambda: float(_env("CRASH_LOOP_WINDOW_S", "300")))
    # Port where `tinkerflow up` itself serves Prometheus /metrics (restarts per part; 0: off).
    up_metrics_port: int = field(default_factory=lambda: int(_env("UP_METRICS_PORT", "0")))

    # Every this many optim steps a run saves an automatic snapshot (adapter + Adam state) to the checkpoint root;
    # with the ops since (their inputs stay in the claim-check store) a dead JAX worker's runs are restored exactly.
    auto_snapshot_every: int = field(default_factory=lambda: int(_env("AUTO_SNAPSHOT_EVERY", "10")))
    # Claim-check objects (request bodies, results) older than this are collected (0: never). Runs replay request
    # bodies since their last automatic snapshot after a worker dies, so keep this well above a step's duration.
    store_retention_s: float = field(default_factory=lambda: float(_env("STORE_RETENTION_S", "86400")))
    # Where checkpoints live (DESIGN §4): file:///path or gs://bucket/prefix. Every process kind needs the same one.
    checkpoint_root: str = field(default_factory=lambda: _env("CHECKPOINT_ROOT", ""))
    # Key that signs the download URLs the API hands out (external_weights_urls). API replicas must share it;
    # empty: a random key kept in <state-dir>/url-signing.key.
    url_signing_key: str = field(default_factory=lambda: _env("URL_SIGNING_KEY", ""))
    # Who may read the API's Prometheus /metrics (its labels name served models, which may be local paths):
    # "key" (any accepted API key, as X-API-Key or `Authorization: Bearer`), "public" (a scraper without
    # credentials), or "off". With no API keys configured the API is open, and so is "key".
    metrics_access: str = field(default_factory=lambda: _env("METRICS_ACCESS", "key"))
    # Serve the OpenAPI schema and its pages (/openapi.json, /docs, /redoc) to anyone. Off by default: nothing
    # there is secret, but a server on the internet need not advertise its routes.
    api_docs: bool = field(default_factory=lambda: _env("API_DOCS", "0").lower() in ("1", "true", "yes"))

    # Multi-host JAX worker (DESIGN §4): num_processes > 1 joins jax.distributed at coordinator_address (host:port
    # of process 0); process 0 takes activities and drives the others through the same steps.
    coordinator_address: str = field(default_factory=lambda: _env("COORDINATOR_ADDRESS", ""))
    num_processes: int = field(default_factory=lambda: int(_env("NUM_PROCESSES", "1")))
    process_id: int = field(default_factory=lambda: int(_env("PROCESS_ID", "0")))
    # The JAX worker's device mesh: devices on the fsdp axis (0: every device not on tp) and on the tp axis.
    mesh_fsdp: int = field(default_factory=lambda: int(_env("MESH_FSDP", "0")))
    mesh_tp: int = field(default_factory=lambda: int(_env("MESH_TP", "1")))
    # Expert-parallel devices (mixture-of-experts models only; 1: no ep axis).
    mesh_ep: int = field(default_factory=lambda: int(_env("MESH_EP", "1")))

    # `tinkerflow ray` (DESIGN §6c): the Ray cluster to join ("" or "auto": the one this process runs in, as under
    # `ray job submit`), and the placement group of JAX-worker actors, one bundle per host.
    ray_address: str = field(default_factory=lambda: _env("RAY_ADDRESS", ""))
    ray_hosts: int = field(default_factory=lambda: int(_env("RAY_HOSTS", "1")))
    ray_cpus_per_host: float = field(default_factory=lambda: float(_env("RAY_CPUS_PER_HOST", "1")))
    ray_gpus_per_host: float = field(default_factory=lambda: float(_env("RAY_GPUS_PER_HOST", "0")))
    ray_tpus_per_host: float = field(default_factory=lambda: float(_env("RAY_TPUS_PER_HOST", "0")))
    # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD (Ray's placement strategies); one JAX process per host: STRICT_SPREAD.
    ray_strategy: str = field(default_factory=lambda: _env("RAY_STRATEGY", "STRICT_SPREAD"))
    # How often Ray may restart each actor (-1: without limit). Re-forming the group restarts every actor once.
    ray_max_restarts: int = field(default_factory=lambda: int(_env("RAY_MAX_RESTARTS", "10")))

    @property
    def resolved_store_url(self) -> str:
        return self.store_url or (self.state_dir / "store").as_uri()

    @property
    def resolved_checkpoint_root(self) -> str:
        return self.checkpoint_root or (self.state_dir / "checkpoints").as_uri()

    def accepted_api_keys(self) -> tuple[str, ...]:
        keys = list(self.api_keys)
        if self.api_keys_file:
            for line in Path(self.api_keys_file).expanduser().read_text().splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    keys.append(line)
        return tuple(dict.fromkeys(keys))

    @property
    def models_dir(self) -> Path:
        return self.state_dir / "models"

    def with_args(self, args: argparse.Namespace) -> Settings:
        """Overlay the flags a user actually gave (argparse leaves the others as None)."""
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(args, f.name, None)
            if value is None:
                continue
            if f.name == "state_dir":
                value = Path(value).expanduser().resolve()
            elif f.name == "api_keys":
                value = tuple(k for part in value for k in part.split(",") if k.strip())
            changes[f.name] = value
        return dataclasses.replace(self, **changes)


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("common (each also read from TINKERFLOW_<NAME> in the environment)")
    g.add_argument("--state-dir", help="directory for the Temporal database, models and the local store "
                   "(env TINKERFLOW_STATE_DIR; default ./.tinkerflow)")
    g.add_argument("--temporal-address", help="host:port of the Temporal frontend (default 127.0.0.1:7233)")
    g.add_argument("--temporal-namespace", help="Temporal namespace (default 'default')")
    g.add_argument("--temporal-tls-cert", help="PEM client certificate for mTLS to Temporal (Temporal Cloud)")
    g.add_argument("--temporal-tls-key", help="PEM private key of --temporal-tls-cert")
    g.add_argument("--temporal-tls-ca", help="PEM CA bundle of the Temporal frontend (default: system CAs)")
    g.add_argument("--store-url", help="claim-check store root: file:///path or gs://bucket/prefix "
                   "(default <state-dir>/store)")
    g.add_argument("--store-retention-s", type=float, help="collect claim-check objects older than this "
                   "(default 86400; 0: never)")
    g.add_argument("--checkpoint-root", help="checkpoint storage root: file:///path or gs://bucket/prefix "
                   "(default <state-dir>/checkpoints)")
    g.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="logging level (default INFO)")
    g.add_argument("--log-format", choices=["text", "json"], help="text for people, json (one object per line) "
                   "for log pipelines (default text)")
