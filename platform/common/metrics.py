"""Prometheus series an operator scrapes from the API and the JAX workers (`/metrics`).

Names follow Prometheus conventions (`_total` counters, `_seconds` histograms); labels stay low-cardinality
(route, op kind, base model, tenant: the key id, one per API key): never a session, run or request id, never a key.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

# --- API ------------------------------------------------------------------------------------------------------------
API_REQUESTS = Counter("tinkerflow_api_requests_total", "HTTP requests answered by the API", ["route", "status"])
API_LATENCY = Histogram(
    "tinkerflow_api_request_seconds",
    "HTTP request latency at the API (submit, not the op)",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
SAMPLE_BATCHES = Counter(
    "tinkerflow_api_sample_batches_total", "sample batch workflows (SampleRequest) the API started for asample calls"
)
BATCH_RESULT_FETCHES = Counter(
    "tinkerflow_api_batch_result_fetches_total",
    "Temporal result waits on sample batch workflows (one per batch, shared by all its futures' polls)",
)
RESULT_REPOLLS = Counter(
    "tinkerflow_api_result_repolls_total",
    "workflow result waits asked again after RESULT_POLL_S without an answer (a long-running workflow, or a history "
    "long poll that missed its close)",
)
QUEUE_DEPTH_QUERIES = Counter(
    "tinkerflow_api_queue_depth_queries_total",
    "Coordinator queue-depth queries sent for asample's 429 check (one at a time, shared by concurrent calls)",
)
SAMPLING_QUEUE = Gauge("tinkerflow_sampling_queue_depth", "samples waiting in a coordinator's queue", ["base_model"])

# --- API: per tenant (`tenant`: the key id, "open" when the API takes any key). Usage comes from the metering ledgers
# (platform/api/ledger_watch.py), counted from the API's start; refusals from the API's quota checks.
TENANT_TRAINING_TOKENS = Counter(
    "tinkerflow_tenant_training_tokens_total", "training tokens metered (forward_backward and forward)", ["tenant"]
)
TENANT_PROMPT_TOKENS = Counter(
    "tinkerflow_tenant_sampling_prompt_tokens_total",
    "sampling prompt (prefill) tokens metered, by whether the prefix cache served them",
    ["tenant", "cached"],
)
TENANT_SAMPLED_TOKENS = Counter("tinkerflow_tenant_sampled_tokens_total", "tokens sampled (generated)", ["tenant"])
QUOTA_REFUSALS = Counter(
    "tinkerflow_tenant_quota_refusals_total",
    "requests and ops refused by a quota of the quota file",
    ["tenant", "quota"],
)
QUOTA_RELOADS = Counter("tinkerflow_quota_reloads_total", "quota file reloads on SIGHUP, by result", ["result"])
LEDGER_READS = Counter(
    "tinkerflow_api_ledger_reads_total",
    "reads of the metering ledgers for quota tallies and tenant counters",
    ["result"],
)

# --- JAX worker -----------------------------------------------------------------------------------------------------
ENGINE_OP_SECONDS = Histogram(
    "tinkerflow_engine_op_seconds",
    "engine time per group of one kind in a batch",
    ["kind"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
BATCH_ITEMS = Histogram(
    "tinkerflow_engine_batch_items",
    "requests per engine call (how much batching happened)",
    ["kind"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)
ENGINE_TOKENS = Counter("tinkerflow_engine_tokens_total", "tokens processed (trained or generated)", ["kind"])
ENGINE_TOKENS_PER_S = Gauge("tinkerflow_engine_tokens_per_second", "tokens/s of the most recent engine call", ["kind"])
ADAPTER_SLOTS_USED = Gauge("tinkerflow_adapter_slots_used", "LoRA adapter slots holding a training run")
ADAPTER_SLOTS_TOTAL = Gauge("tinkerflow_adapter_slots_total", "LoRA adapter slots on this worker")

# --- host memory (JAX worker): memory mappings and compiled programs are read when Prometheus scrapes, by a collector
# in workers/host_memory.py (tinkerflow_worker_*; docs/metrics.md §Host memory series).

# --- accelerators (JAX worker; activities/accelerator_metrics.py says how MFU is estimated) ---------------------------
DEVICE_MEMORY_IN_USE = Gauge(
    "tinkerflow_device_memory_in_use_bytes",
    "device memory in use (memory_stats; absent where JAX reports none)",
    ["device"],
)
DEVICE_MEMORY_PEAK = Gauge("tinkerflow_device_memory_peak_bytes", "peak device memory in use since start", ["device"])
DEVICE_MEMORY_LIMIT = Gauge("tinkerflow_device_memory_limit_bytes", "device memory JAX may use", ["device"])
# The device-memory plan (workers/engine/runtime/memory_plan.py), set once when the engine is loaded.
MEMORY_PLAN_BYTES = Gauge(
    "tinkerflow_memory_plan_bytes",
    "the device-memory plan: capacity and its parts (resident weights and slots, snapshots, reserve, work)",
    ["part"],
)
MEMORY_PLAN_MAX_TOKENS = Gauge(
    "tinkerflow_memory_plan_max_tokens",
    "tokens the memory plan admits per forward_backward datum or sampled sequence",
    ["op"],
)
MEMORY_PLAN_BYTES_PER_TOKEN = Gauge(
    "tinkerflow_memory_plan_bytes_per_token",
    "the plan's per-token costs (training with checkpointing; KV cache)",
    ["kind"],
)
ENGINE_MFU = Gauge(
    "tinkerflow_engine_mfu", "model FLOPs utilisation (0..1) of the most recent engine call of this kind", ["kind"]
)
ENGINE_FLOPS = Counter(
    "tinkerflow_engine_flops_total", "model FLOPs of engine calls (estimate from the config)", ["kind"]
)

# --- paging: more training runs than adapter slots (JAX worker; workers/engine/runtime/paging_store.py) ---------------
ADAPTER_RUNS_PAGED = Gauge(
    "tinkerflow_adapter_runs_paged", "training runs' adapters paged out of the device (host memory or files)"
)
ADAPTER_PAGE_CAPACITY = Gauge(
    "tinkerflow_adapter_page_capacity", "adapters this worker can hold paged out besides its slots (its page budgets)"
)
PAGE_MOVES = Counter(
    "tinkerflow_adapter_page_moves_total", "adapters paged between device slots and the page store", ["direction"]
)
PAGE_INS_FROM_DISK = Counter(
    "tinkerflow_adapter_page_ins_from_disk_total", "page-ins read back from files (past the host memory budget)"
)
PAGE_FAILURES = Counter("tinkerflow_adapter_page_failures_total", "page moves that failed (that run restores itself)")
PAGE_SECONDS = Histogram(
    "tinkerflow_adapter_page_seconds",
    "time to page one adapter out of its slot or into one",
    ["direction"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
PAGE_STORE_BYTES = Gauge("tinkerflow_adapter_page_store_bytes", "bytes held in the page store", ["tier"])
PAGE_INS_PER_SECOND = Gauge("tinkerflow_adapter_page_ins_per_second", "adapters paged in per second, last minute")
PAGE_IN_SECONDS_RECENT = Gauge(
    "tinkerflow_adapter_page_in_seconds_recent", "mean seconds to page one adapter in, over the last minute"
)
