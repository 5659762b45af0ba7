"""Settings shared by every process kind, from flags and `TINKERFLOW_*` environment variables.

One frozen dataclass so a process's whole configuration is visible in one place and can be logged at start-up.
Each field states its default, its help text and the flag group it belongs to once, in its metadata
(`setting(...)`); the CLI's flags and their help are generated from it (`tinkerflow.cli.flags`), and every field is
read from `TINKERFLOW_<FIELD_NAME>`. Flags win over the environment, the environment wins over the defaults.
Fields in `ENV_ONLY` groups have no flag: tuning knobs read where no Settings object reaches and test hooks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinkerflow.common.errors import UserError

ENV_PREFIX = "TINKERFLOW_"

# Flag groups: each sub-command of the CLI shows the groups it needs (cli/main.py); titles head its --help sections.
COMMON, MODEL, API, DEV_TEMPORAL, SUPERVISION, JAX_WORKER, MESH, RAY = (
    "common",
    "model",
    "api",
    "dev-temporal",
    "supervision",
    "jax-worker",
    "mesh",
    "ray",
)
ENGINE_ENV, TEST_HOOK = "engine-env", "test-hook"
ENV_ONLY = (ENGINE_ENV, TEST_HOOK)
GROUP_TITLES = {
    COMMON: "common",
    MODEL: "base model and JAX worker",
    API: "HTTP API",
    DEV_TEMPORAL: "Temporal dev server (when no --temporal-address is given)",
    SUPERVISION: "supervision by `up`",
    JAX_WORKER: "JAX worker (multi-host: one process per host)",
    MESH: "device mesh",
    RAY: "Ray placement",
}


class SettingsError(UserError):
    """A TINKERFLOW_* variable (or flag) whose value does not parse as its field's type (a usage error: exit 2)."""


class _Unset:
    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()


def _parse_bool(raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("expected 1/0, true/false, yes/no or on/off")


def _parse_keys(raw: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in raw.split(",") if k.strip())


def _parse_sizes(raw: str) -> tuple[int, ...]:
    sizes = tuple(int(k) for k in _parse_keys(raw))
    if not sizes or min(sizes) < 1:
        raise ValueError("expected positive whole numbers, comma-separated")
    return sizes


def _parse_path(raw: str) -> Path:
    return Path(raw).expanduser().resolve()


def _parser_for(default: Any) -> Callable[[str], Any]:
    if isinstance(default, bool):
        return _parse_bool
    if isinstance(default, tuple):
        return _parse_keys
    if isinstance(default, (int, float)):
        return type(default)
    return str


def setting(
    default: Any,
    help: str,
    group: str,
    *,
    shown: str | None = None,
    aliases: tuple[str, ...] = (),
    choices: tuple[str, ...] = (),
    metavar: str | None = None,
    env_fallbacks: tuple[str, ...] = (),
    parse: Callable[[str], Any] | None = None,
) -> Any:
    """A Settings field: `default` (a callable: computed when the field is read), `help` (one sentence, no
    default in it: the flag's help adds the default and the env var), `group` (which sub-commands get the flag),
    `shown` (the default as a person reads it, where its value says little), `aliases` (older flag names that
    keep working), `env_fallbacks` (variables read after TINKERFLOW_<NAME>, e.g. Ray's own RAY_ADDRESS)."""
    meta = {
        "default": default,
        "help": help,
        "group": group,
        "shown": shown,
        "aliases": aliases,
        "choices": choices,
        "metavar": metavar,
        "env_fallbacks": env_fallbacks,
        "parse": parse or _parser_for(default),
    }
    return field(default=_UNSET, metadata=meta)


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _cwd_state_dir() -> Path:
    return (Path.cwd() / ".tinkerflow").resolve()


@dataclass(frozen=True)
class Settings:
    # The fields are a table (name, default, help, group): one field per entry, laid out by hand so it reads as one.
    # fmt: off
    # --- common to every process kind
    # The RUF009 exemption below: setting() returns a dataclasses.field() (a field specifier), not a shared default.
    state_dir: Path = setting(_cwd_state_dir, "directory for the Temporal database, models and the local store",  # noqa: RUF009
                              COMMON, shown="./.tinkerflow", parse=_parse_path)
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
    log_level: str = setting("INFO", "logging level", COMMON, choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    log_format: str = setting("text", "text for people, json (one object per line) for log pipelines", COMMON,
                              choices=("text", "json"))

    # --- the base model and the JAX worker that serves it
    base_model: str = setting("", "HF id in the local HF cache, or a local HF directory", MODEL,
                              shown="the embedded tiny Qwen3, made on first use in <state-dir>/models")
    served_model_name: str = setting("", "name clients use for --base-model, like vLLM's flag of that name: serve a "
                                     "local copy of a Hugging Face model under its HF id (e.g. Qwen/Qwen3-0.6B) so "
                                     "recipes that look models up by name (tinker-cookbook's renderer and "
                                     "learning-rate tables) know it", MODEL,
                                     shown="the HF id given to --base-model, or the directory's absolute path")
    pool: str = setting("default", "name of the worker pool this base model runs on", MODEL)
    max_lora_adapters: int = setting(8, "LoRA adapter slots on the JAX worker", MODEL)
    max_lora_rank: int = setting(32, "largest LoRA rank a client may ask for", MODEL)
    snapshot_budget_mb: int = setting(0, "device memory (MiB) for sampler snapshots on the JAX worker; the least "
                                      "recently used are evicted past it (saved weights reload on demand)", MODEL,
                                      shown="0: a tenth of the device's memory")
    metrics_port: int = setting(0, "serve the JAX worker's Prometheus /metrics on this port (the API always serves "
                                "/metrics on its own port)", MODEL, shown="0: off")
    run_metrics_max_points: int = setting(2000, "metric points kept per training run in the store (one per "
                                          "training op and per sample call); past it the older half is thinned, "
                                          "every second point of each kind dropped", MODEL)
    peak_tflops: float = setting(0.0, "peak dense TFLOP/s of one accelerator, the denominator of the JAX worker's "
                                 "MFU estimate (tinkerflow_engine_mfu)", MODEL,
                                 shown="0: from a table of known devices (H100, H200, A100, TPU v5e/v6e), else a "
                                 "nominal CPU figure")
    # On Kubernetes, a path on a volume that outlives pods, so a rescheduled worker starts warm.
    compilation_cache_dir: str = setting("", "XLA persistent compilation cache of the JAX worker, so a restarted "
                                         "worker compiles nothing it compiled before; 'off' disables it", MODEL,
                                         metavar="DIR", shown="<state-dir>/xla-cache")
    # What the JAX worker compiles ahead of traffic (workers/engine/warm_up.py). Measured on the tiny model on the
    # shared 2-core box at load 10-17 (no quiet figure yet): the first-request lifecycle (24 programs) 83-90 s cold,
    # 18-20 s read back from a warm --compilation-cache-dir; all default shapes (66 programs) 300-370 s cold.
    warm_up: str = setting("background", "when the JAX worker compiles ahead of traffic: 'ready' compiles every "
                           "warm-up shape below before it registers (nothing compiles later, readiness waits); "
                           "'background' compiles what a first training request needs (an adapter's create, "
                           "forward_backward and optim_step at the smallest shapes) before it registers, what a "
                           "first user needs next (forward, the 8-datum bucket, snapshot, sample) right after, and "
                           "the other shapes one at a time between requests; "
                           "'off' compiles each program at its first use", MODEL,
                           choices=("ready", "background", "off"))
    # Measured on the shared 2-core box (load 5-7): the lifecycle's training half plus the 8-datum bucket took
    # 34 s on one thread, 39-49 s on two (XLA's CPU compile already keeps the cores busy); more may help on a host
    # with many idle cores.
    warm_up_threads: int = setting(1, "threads the JAX worker's warm-up compiles train buckets on, side by side "
                                   "(XLA releases the GIL while it compiles)", MODEL, metavar="N")
    warm_up_train_rows: tuple[int, ...] = setting((1, 2, 4, 8), "datums per forward_backward/forward to compile "
                                                  "ahead (rounded up to powers of two), each at every "
                                                  "--warm-up-train-lens", MODEL, shown="1,2,4,8", metavar="N[,N...]",
                                                  parse=_parse_sizes)
    warm_up_train_lens: tuple[int, ...] = setting((32, 64, 128), "tokens per datum to compile ahead (rounded up "
                                                  "to the buckets 16, 24, 32, 48, 64, 96, 128, ...)", MODEL,
                                                  shown="32,64,128", metavar="N[,N...]", parse=_parse_sizes)
    warm_up_prompt_lens: tuple[int, ...] = setting((16, 32, 64), "sampling prompt lengths to compile ahead "
                                                   "(rounded up like --warm-up-train-lens), each at every "
                                                   "--warm-up-cache-lens", MODEL, shown="16,32,64",
                                                   metavar="N[,N...]", parse=_parse_sizes)
    warm_up_cache_lens: tuple[int, ...] = setting((128, 256), "sampling prompt + max_tokens totals to compile "
                                                  "ahead (rounded up to powers of two, at least 128)", MODEL,
                                                  shown="128,256", metavar="N[,N...]", parse=_parse_sizes)

    # --- the HTTP API
    host: str = setting("127.0.0.1", "address the API binds", API)
    port: int = setting(8000, "port of the API", API)
    api_keys: tuple[str, ...] = setting((), "accepted API key, repeatable or comma-separated", API,
                                        aliases=("--api-key",), shown="none: any key is accepted, with a warning")
    api_keys_file: str = setting("", "file of accepted API keys, one per line ('#' comments allowed), merged with "
                                 "--api-key; read once when the API starts", API, shown="none")
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
    long_poll_s: float = setting(25.0, "how long retrieve_future holds a poll before answering try_again (the SDK "
                                 "times out at 45 s)", API)
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

    # --- one JAX worker process (DESIGN §4): num_processes > 1 joins jax.distributed at coordinator_address;
    # process 0 takes activities and drives the others through the same steps.
    worker_id: str = setting("", "stable id of this worker, the same across its restarts", JAX_WORKER,
                             shown="<hostname>-<pool>-0")
    coordinator_address: str = setting("", "jax.distributed coordinator: process 0's host and a free port",
                                       JAX_WORKER, metavar="HOST:PORT", shown="none: one process")
    num_processes: int = setting(1, "processes (hosts) in the worker; above 1 they join jax.distributed, process 0 "
                                 "takes activities and drives the others", JAX_WORKER)
    process_id: int = setting(0, "this process's index in [0, N)", JAX_WORKER, metavar="I")
    mesh_fsdp: int = setting(0, "devices on the mesh's fsdp axis, over all processes", MESH,
                             shown="0: every device not on tp")
    mesh_tp: int = setting(1, "devices on the mesh's tp (tensor-parallel) axis", MESH)
    mesh_ep: int = setting(1, "devices on the mesh's ep (expert-parallel) axis, for mixture-of-experts models; "
                           "num_experts must divide by it", MESH, shown="1: no ep axis")

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

    # --- no flag: read from the environment only (documented exceptions, see the module docstring)
    sampler_eager_buckets: bool = setting(True, "compile every slot bucket of a sampling shape family at its first "
                                          "use (0: each bucket when a batch first needs it); read by the engine's "
                                          "sampler where it is built", ENGINE_ENV)
    fault_pause_before_commit_s: float = setting(0.0, "test hook: hold a checkpoint save this long between its "
                                                 "payload upload and its manifest commit", TEST_HOOK)

    # Which fields came from the environment or a flag rather than their default (e.g. `up` starts its own Temporal
    # only when no address was given). Not configuration itself: no flag, no variable.
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    # fmt: on

    def __post_init__(self) -> None:
        given = set(self.given)
        for f in config_fields():
            if getattr(self, f.name) is not _UNSET:
                continue
            raw, source = _from_env(f)
            if source:
                value = _parse(f, raw, source)
                given.add(f.name)
            else:
                default = f.metadata["default"]
                value = default() if callable(default) else default
            object.__setattr__(self, f.name, value)
        object.__setattr__(self, "given", frozenset(given))

    def is_given(self, name: str) -> bool:
        """The field was set by a flag, the environment or the caller, not left at its default."""
        f = next(f for f in config_fields() if f.name == name)
        default = f.metadata["default"]
        return name in self.given or getattr(self, name) != (default() if callable(default) else default)

    def as_env(self) -> dict[str, str]:
        """Every field as the TINKERFLOW_* variable that reads back to the same value (the store and checkpoint
        roots resolved against this state dir): what a child process needs to share this configuration. The
        ENV_ONLY fields are left out: they are read from the environment where they are used, so a child inherits
        the variable itself (a test may set a fault hook after this Settings was made)."""
        values = {f.name: getattr(self, f.name) for f in config_fields() if f.metadata["group"] not in ENV_ONLY}
        values.update(store_url=self.resolved_store_url, checkpoint_root=self.resolved_checkpoint_root)
        return {env_name(name): _to_env(value) for name, value in values.items()}

    @property
    def resolved_store_url(self) -> str:
        return self.store_url or (self.state_dir / "store").as_uri()

    @property
    def resolved_checkpoint_root(self) -> str:
        return self.checkpoint_root or (self.state_dir / "checkpoints").as_uri()

    @property
    def resolved_temporal_ui_url(self) -> str:
        """--temporal-ui-url, else where `tinkerflow up`'s dev server serves its UI (the frontend's host, --ui-port)."""
        if self.temporal_ui_url:
            return self.temporal_ui_url.rstrip("/")
        host = self.temporal_address.rsplit(":", 1)[0] or "127.0.0.1"
        return f"http://{host}:{self.ui_port}"

    @property
    def resolved_compilation_cache_dir(self) -> Path | None:
        if self.compilation_cache_dir == "off":
            return None
        return (
            Path(self.compilation_cache_dir).expanduser()
            if self.compilation_cache_dir
            else self.state_dir / "xla-cache"
        )

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
        """Overlay the flags a user actually gave (the generated flags default to None)."""
        changes: dict[str, Any] = {}
        for f in config_fields():
            value = getattr(args, f.name, None)
            if value is None:
                continue
            if isinstance(value, list):  # a repeatable flag (--api-key): each item may itself be comma-separated
                value = ",".join(value)
            changes[f.name] = _parse(f, value, "--" + f.name.replace("_", "-")) if isinstance(value, str) else value
        return dataclasses.replace(self, given=self.given | set(changes), **changes)


def _to_env(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def config_fields() -> Iterator[dataclasses.Field]:
    """The configuration fields (each with a TINKERFLOW_* variable), in declaration order."""
    return (f for f in dataclasses.fields(Settings) if "group" in f.metadata)


def env_names(f: dataclasses.Field) -> tuple[str, ...]:
    return (env_name(f.name), *f.metadata["env_fallbacks"])


def _from_env(f: dataclasses.Field) -> tuple[str, str]:
    for name in env_names(f):
        if name in os.environ:
            return os.environ[name], name
    return "", ""


def _parse(f: dataclasses.Field, raw: str, source: str) -> Any:
    try:
        value = f.metadata["parse"](raw)
    except ValueError as e:
        raise SettingsError(f"{source}={raw!r}: not a valid {f.name} ({e})") from None
    choices = f.metadata["choices"]
    if choices and value not in choices:
        raise SettingsError(f"{source}={raw!r}: {f.name} must be one of {', '.join(choices)}")
    return value


def env_setting(name: str) -> Any:
    """One field as the environment sets it (or its default): for the ENV_ONLY fields, read where no Settings
    object is passed (the engine's sampler, test hooks in activities)."""
    f = next(f for f in config_fields() if f.name == name)
    raw, source = _from_env(f)
    if source:
        return _parse(f, raw, source)
    default = f.metadata["default"]
    return default() if callable(default) else default
