"""The settings of the HTTP API process (`tinkerflow api`): where it listens, which keys it accepts, its limits."""

from __future__ import annotations

from dataclasses import dataclass

from tinkerflow.common.settings_schema import API, setting


@dataclass(frozen=True)
class ApiSettings:
    """Settings fields of the API (flag group `api`)."""

    # The fields are a table (name, default, help, group): one field per entry, laid out by hand so it reads as one.
    # fmt: off
    # --- the HTTP API
    host: str = setting("127.0.0.1", "address the API binds", API)
    port: int = setting(8000, "port of the API", API)
    api_keys: tuple[str, ...] = setting((), "accepted API key, repeatable or comma-separated", API,
                                        aliases=("--api-key",), shown="none: any key is accepted, with a warning")
    api_keys_file: str = setting("", "file of accepted API keys, one per line ('#' comments allowed), merged with "
                                 "--api-key; read once when the API starts", API, shown="none")
    admin_api_key: str = setting("", "operator key: accepted like --api-key (its own tenant) and, on the billing "
                                 "and audit routes (tinker's AdminClient), sees every tenant's usage", API,
                                 shown="none: each key sees only its own usage")
    session_timeout_s: float = setting(120.0, "end a session after this long without a heartbeat", API)
    max_queued_samples: int = setting(1024, "answer asample with HTTP 429 (the SDK backs off and retries) while "
                                      "this many samples are queued for one base model", API)
    max_queued_sample_tokens: int = setting(1 << 20, "answer asample with HTTP 429 while this many tokens of "
                                            "sampling work (samples x (prompt + max_tokens)) are queued for one "
                                            "base model", API, shown="1Mi")
    max_request_bytes: int = setting(256 << 20, "refuse request bodies larger than this with HTTP 413, on the wire "
                                     "and after zstd decompression", API, shown="256 MiB")
    max_sample_body_bytes: int = setting(16 << 20, "HTTP 413 for an asample body larger than this, before it is "
                                         "read", API, shown="16 MiB")
    max_control_body_bytes: int = setting(1 << 20, "HTTP 413 for a body larger than this on every route but "
                                          "forward_backward and asample, before it is read", API, shown="1 MiB")
    max_samples_per_request: int = setting(128, "largest num_samples one asample may ask for (HTTP 400 beyond)",
                                           API)
    max_sample_tokens: int = setting(8192, "largest max_tokens one asample may ask for (HTTP 400 beyond)", API)
    max_datums_per_request: int = setting(4096, "most datums in one forward_backward (beyond, its future fails "
                                          "with a user error)", API)
    # pyqwest's asyncio transport reports a finished request from its own Rust thread; when that lands while the
    # client's interpreter is finalizing, Python ends the thread with pthread_exit and the process aborts (SIGABRT).
    # A sampling client always has a long poll in flight, so a script that samples and exits hits it now and then.
    client_transport: str = setting("httpx", "HTTP transport /client/config tells the tinker SDK to use: httpx (pure "
                                    "Python) or pyqwest (Rust; an SDK that exits with a request in flight can then "
                                    "die with SIGABRT, exit code 134)", API, choices=("httpx", "pyqwest"))
    long_poll_s: float = setting(25.0, "how long retrieve_future holds a poll before answering try_again (the SDK "
                                 "times out at 45 s)", API)
    max_live_runs_per_tenant: int = setting(256, "most live LoRA training runs one API key may hold on one base "
                                            "model; a create past it fails with a user error saying so (0: no "
                                            "limit). Runs beyond the JAX workers' slots are paged out, so this, "
                                            "not the slots, is what bounds one tenant", API)
    quota_file: str = setting("", "TOML file of quotas and rate limits per API key (docs/operations.md §Quotas); "
                              "read at start, again on SIGHUP to the API process", API, shown="none: no quotas")
    ledger_read_s: float = setting(15.0, "how often the API reads the metering ledgers: settles the quota tallies "
                                   "and fills the per-tenant /metrics counters", API)
    auto_snapshot_every: int = setting(10, "save an automatic snapshot of each run every N optim steps, so a dead "
                                       "JAX worker's runs are restored exactly elsewhere (0: off, a dead worker's "
                                       "runs then fail)", API)
    url_signing_key: str = setting("", "secret that signs checkpoint download URLs; API replicas must share it", API,
                                   shown="a random key kept in <state-dir>/url-signing.key")
    # The API's /metrics labels name served models, which may be local paths.
    metrics_access: str = setting("key", "who may read the API's /metrics: any accepted API key (X-API-Key or "
                                  "Authorization: Bearer), anyone (public), or nobody (off); with no API keys "
                                  "configured the API is open, and so is 'key'", API,
                                  choices=("key", "public", "off"))
    # Nothing there is secret, but a server on the internet need not advertise its routes.
    api_docs: bool = setting(False, "serve /openapi.json, /docs and /redoc to anyone", API, shown="off")
    # The console's tokens/s, MFU and device memory: only the engine measures them (platform/api/worker_metrics.py).
    worker_metrics_urls: tuple[str, ...] = setting((), "JAX workers' Prometheus /metrics URLs the console reads "
                                                   "tokens/s, MFU and device memory from, repeatable or "
                                                   "comma-separated", API,
                                                   shown="http://<host>:<metrics-port>/metrics when --metrics-port "
                                                   "is set, else none")
    # The console's "open in Temporal UI" links (docs/console.md); the UI itself is Temporal's, not ours.
    temporal_ui_url: str = setting("", "base URL of the Temporal Web UI, for the console's links to each run's "
                                   "workflow", API, shown="http://<temporal host>:<ui-port>, as `up` prints it")
    # fmt: on
