"""The settings of a JAX worker process (`tinkerflow jax-worker`): the base model it serves, its slots, its warm-up,
its place in a multi-host group and device mesh, and the engine knobs read from the environment only."""

from __future__ import annotations

from dataclasses import dataclass

from tinkerflow.common.settings_schema import ENGINE_ENV, JAX_WORKER, MESH, MODEL, TEST_HOOK, parse_sizes, setting


def _at_least_zero(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("0 (auto) or more")
    return value


def _pipeline_depth(raw: str) -> int:
    depth = int(raw)
    if depth not in (1, 2):
        raise ValueError("1 (a batch at a time) or 2 (the next one queued behind the running one)")
    return depth


@dataclass(frozen=True)
class JaxWorkerSettings:
    """Settings fields of a JAX worker (flag groups `model`, `jax-worker`, `mesh`; `engine-env` and `test-hook`
    have no flag)."""

    # The fields are a table (name, default, help, group): one field per entry, laid out by hand so it reads as one.
    # fmt: off
    # --- the base model and the JAX worker that serves it
    base_model: str = setting("", "HF id in the local HF cache, or a local HF directory", MODEL,
                              shown="the embedded tiny Qwen3, made on first use in <state-dir>/models")
    served_model_name: str = setting("", "name clients use for --base-model, like vLLM's flag of that name: serve a "
                                     "local copy of a Hugging Face model under its HF id (e.g. Qwen/Qwen3-0.6B) so "
                                     "recipes that look models up by name (tinker-cookbook's renderer and "
                                     "learning-rate tables) know it", MODEL,
                                     shown="the HF id given to --base-model, or the directory's absolute path")
    random_weights: bool = setting(False, "draw the base weights at random, in the shape of --base-model's "
                                   "config.json, instead of reading its safetensors: a real model's shape served "
                                   "without its checkpoint, for benchmarks (a directory with config.json alone "
                                   "will do; its tokenizer is used where it has one)", MODEL)
    pool: str = setting("default", "name of the worker pool this base model runs on", MODEL)
    max_lora_adapters: int = setting(8, "LoRA adapter slots on the JAX worker", MODEL)
    max_lora_rank: int = setting(32, "largest LoRA rank a client may ask for", MODEL)
    snapshot_budget_mb: int = setting(0, "device memory (MiB) for sampler snapshots on the JAX worker; the least "
                                      "recently used are evicted past it (saved weights reload on demand)", MODEL,
                                      shown="0: a tenth of the device's memory")
    device_memory_gb: float = setting(0.0, "memory (GiB) the JAX worker's device-memory plan divides between "
                                      "weights, adapter slots, snapshots and work; what can never fit in it is "
                                      "refused as the caller's error before anything is allocated", MODEL,
                                      shown="0: the device's own (the accelerator allocator's limit; host memory "
                                      "on CPU)")
    prefix_cache_tokens: int = setting(65536, "prompt tokens of keys and values the sampler keeps on the device "
                                       "for prompts that start the same way (a prefix KV cache per sampling "
                                       "session, least recently used out); counted in the device-memory plan",
                                       MODEL, shown="65536; 0: off")
    # The sampler's layer loop over a dense model's stacked layers (workers/engine/model/decoder_stack.py): a scan
    # copies each layer's weights out of the stack on a GPU; unrolled trades that for compile time growing with depth.
    decode_layers: str = setting("auto", "how the sampler's prefill and decode run a dense model's stacked layers: "
                                 "'scan' (one layer's program whatever the depth; on a GPU each layer's weights "
                                 "are copied out of the stack) or 'unrolled' (a loop over static slices of the "
                                 "stacked weights; compile time grows with depth); training always scans", MODEL,
                                 choices=("auto", "scan", "unrolled"),
                                 shown="auto: unrolled on GPU and TPU, scan on CPU")
    # More training runs than slots: the others' adapters wait off the device (workers/engine/runtime/paging_store.py).
    adapter_host_memory_mb: int = setting(0, "host memory (MiB) for training runs' adapters (and sampler snapshots) "
                                          "paged out of the device: runs beyond --max-lora-adapters wait here "
                                          "between their batches; the least recently used move to files past it",
                                          MODEL, shown="0: a quarter of the machine's memory, or of "
                                          "--device-memory-gb when smaller")
    adapter_disk_mb: int = setting(65536, "file space (MiB) for paged-out adapters past --adapter-host-memory-mb, "
                                   "under .paging/ in the checkpoint store (--checkpoint-root); with the host "
                                   "memory it bounds how many runs this worker holds (0: no files)", MODEL,
                                   shown="65536 (64 GiB)")
    pipeline_depth: int = setting(2, "batches the JAX worker holds at once: 2 runs one while the Coordinator's "
                                  "next waits queued behind it, so the engine never waits for the control plane; "
                                  "1 has each batch formed when the last ends, which gathers more small ops of many "
                                  "tenants into one batch", MODEL, parse=_pipeline_depth)
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
    # Compiled programs held in host memory (workers/engine/runtime/program_budget.py): on CPU each holds a few hundred
    # memory mappings, and a long tail of shapes once ran a worker into vm.max_map_count (docs/operations.md §Host
    # settings for a long-lived JAX worker). Auto: on CPU what vm.max_map_count leaves room for, at most 512, well
    # past the bounded program set a workload uses (docs/architecture.md §The bounded program set).
    max_programs: int = setting(0, "compiled XLA programs the JAX worker holds; past it the least recently used is "
                                "dropped and compiled again (or read back from the compilation cache) when next "
                                "needed", MODEL, metavar="N", parse=_at_least_zero,
                                shown="0: auto, what vm.max_map_count allows on CPU, at most 512")
    program_memory_mb: int = setting(4096, "host memory (MiB) the JAX worker's compiled programs' code may take, the "
                                     "least recently used dropped past it (a backend that reports no code size, "
                                     "CPU, counts 4 MiB a program)", MODEL, shown="4096; 0: no bound but "
                                     "--max-programs")
    # What the JAX worker compiles ahead of traffic (workers/engine/warm_up.py): 'background' by default,
    # because compiling every shape before registering takes minutes on a small CPU where the first request's programs
    # take about a minute (figures: docs/benchmarks.md §Measurements behind the code).
    warm_up: str = setting("background", "when the JAX worker compiles ahead of traffic: 'ready' compiles every "
                           "warm-up shape below before it registers (nothing compiles later, readiness waits); "
                           "'background' compiles what a first request needs (an adapter's create, "
                           "forward_backward and optim_step at the smallest shapes, its snapshot and a sample) "
                           "before it registers, what a first user needs next (forward, the 8-datum bucket, the "
                           "other decode-slot buckets) right after, and the other shapes one at a time between "
                           "requests; "
                           "'off' compiles each program at its first use", MODEL,
                           choices=("ready", "background", "off"))
    # One thread by default: on a 2-core box two were slower (XLA's CPU compile already keeps the cores busy); more may
    # help on a host with many idle cores (docs/benchmarks.md §Measurements behind the code).
    warm_up_threads: int = setting(1, "threads the JAX worker's warm-up compiles train buckets on, side by side "
                                   "(XLA releases the GIL while it compiles)", MODEL, metavar="N")
    warm_up_train_rows: tuple[int, ...] = setting((1, 4, 16, 64), "rows per forward_backward/forward micro-batch to "
                                                  "compile ahead (rounded up to powers of four), each at every "
                                                  "--warm-up-train-lens its tokens fit", MODEL, shown="1,4,16,64",
                                                  metavar="N[,N...]", parse=parse_sizes)
    warm_up_train_lens: tuple[int, ...] = setting((256, 1024, 4096), "row lengths to compile ahead (rounded up to "
                                                  "the row lengths 256, 1024, 4096; longer datums to two "
                                                  "significant bits)", MODEL, shown="256,1024,4096",
                                                  metavar="N[,N...]", parse=parse_sizes)
    warm_up_sampler_stacks: tuple[int, ...] = setting((1, 4, 16), "sampler families to compile ahead, by snapshots "
                                                      "per decode batch (stacks of 1, 4, 16), each for every slot "
                                                      "bucket, with and without prompt scoring (--warm-up-scoring)",
                                                      MODEL, shown="1,4,16", metavar="N[,N...]", parse=parse_sizes)
    warm_up_scoring: bool = setting(True, "also compile ahead the sampler admissions that score prompts (prompt "
                                    "logprobs, target logprobs, prompt draws: DPO and distillation recipes)", MODEL)

    # --- one JAX worker process: num_processes > 1 joins jax.distributed at coordinator_address;
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

    # --- no flag: read from the environment only, where no Settings object reaches (settings.env_setting)
    sampler_eager_buckets: bool = setting(True, "compile every slot bucket of a sampling shape family at its first "
                                          "use (0: each bucket when a batch first needs it); read by the engine's "
                                          "sampler where it is built", ENGINE_ENV)
    attention: str = setting("auto", "the engine's attention: 'auto' picks by backend (cuDNN or Pallas on GPU, Pallas "
                             "on TPU, the blockwise path elsewhere); one of the others forces it where it can run; "
                             "read by the model where it traces", ENGINE_ENV,
                             choices=("auto", "reference", "blockwise", "cudnn", "pallas_gpu", "pallas_tpu"))
    fault_pause_before_commit_s: float = setting(0.0, "test hook: hold a checkpoint save this long between its "
                                                 "payload upload and its manifest commit", TEST_HOOK)
    # fmt: on
