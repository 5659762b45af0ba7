"""The JAX worker process: loads one base model into the engine and takes `run_batch` activities on its own queue.

At start it registers with the Coordinator of its base model (signal-with-start), which then routes to this worker's
task queue the work for the adapters it placed here. Batches run one at a time, in the order the Coordinator dispatched
them: the engine holds device state and is not re-entrant, and JAX already uses every core for one step. The worker
takes the next batch while it runs one (pipelined dispatch: workflows/coordinator/dispatch.py), so the next starts the
moment the last ends.

Multi-host (`--num-processes N > 1`, one process per host): every process joins jax.distributed and loads the engine
on a mesh over all their devices; process 0 alone talks to Temporal, through a `DrivenEngine` that has the others
replay each engine call (`follow`), so all of them run the same SPMD steps (workers/engine/multihost.py).

Before it registers (and so before the Coordinator sends it work, and before `--ready-file` appears), the worker
compiles what a first request of each kind runs (`--warm-up`, workers/engine/warm_up.py): with `ready` every
warm-up shape, with `background` (the default) the training half of an adapter's lifecycle at the smallest shapes
(create, forward_backward, optim_step); right after it registered, back to back, the rest of what a first user
needs (the train buckets of a first batch of several datums and of the lifecycle, the first sampler family, the rest
of the lifecycle: export, import, snapshots, sampling), then the other shapes in the pauses of the traffic; one
piece at a time under the engine's lock (an activity waits for one piece at most, heartbeating), except train
buckets: they only compile, beside the traffic. A restart reads back from the persistent compilation cache only
the slot bucket a first sample takes before it registers (about a second: the sampling clients that survived the
restart sample at once), and the rest of the pieces once the recovery (or a first request) was served: read back at
once, they would delay the recovery by as much CPU as it needs itself (docs/benchmarks.md §Measurements behind the
code).

The worker never imports torch (`keep_torch_out`): the tinker SDK's types import it when it is installed, which
cost seconds of every (re)start, and nothing here uses it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import socket
import sys
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING

import prometheus_client
from temporalio.client import Client
from temporalio.worker import Worker

from tinkerflow.activities.accelerator_metrics import AcceleratorMeter, publish_memory_plan
from tinkerflow.common import metrics
from tinkerflow.common.checkpoints import CheckpointStore
from tinkerflow.common.images import model_image_processor
from tinkerflow.common.run_metrics import RunMetricsStore
from tinkerflow.common.settings import Settings
from tinkerflow.common.store import ClaimCheckStore
from tinkerflow.common.temporal import connect
from tinkerflow.workers import host_memory
from tinkerflow.workers.base_model import resolve_base_model
from tinkerflow.workers.engine.types import (
    COMPILE_ONLY_KINDS,
    SamplerWarmUp,
    TrainWarmUp,
    WarmUpPiece,
    WarmUpPlan,
)
from tinkerflow.workers.registration import keep_registered, register
from tinkerflow.workflows.coordinator.dispatch import PIPELINE_DEPTH
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import ModelCard, WorkerInfo

if TYPE_CHECKING:
    from tinkerflow.workers.engine.engine_lock import EngineLock

log = logging.getLogger(__name__)
# The background warm-up starts its next piece only after the engine served nothing for this long: the gaps between
# the ops of one client's loop (a workflow round trip) are far shorter, so a loop in progress is never held up.
WARM_UP_AFTER_IDLE_S = 1.0
# A restarted worker's first piece that runs programs waits this long for the recovery (longer than the coordinator's
# 15 s batch heartbeat timeout, in case it did not fail the old process's batch at once) unless a request came first.
WARM_UP_AFTER_RESTART_S = 20.0


def stable_worker_id(settings: Settings) -> str:
    """Same id across restarts of one worker on one host, so the coordinator can tell a restart from a new worker."""
    return settings.worker_id or f"{socket.gethostname()}-{settings.pool}-0"


async def serve(
    settings: Settings,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    worker_id: str | None = None,
) -> None:
    """Run the JAX worker until `stop` (forever without one); `ready` is set once it has registered."""
    from tinkerflow.activities import wire_images  # here: it imports the tinker SDK, which imports torch
    from tinkerflow.activities.engine_activities import EngineActivities
    from tinkerflow.activities.op_points import OpPoints

    _enable_compile_cache(settings)
    multi_host = settings.num_processes > 1
    if multi_host:  # before anything touches JAX; every process of the worker runs this
        from tinkerflow.workers.engine import multihost

        await asyncio.to_thread(
            multihost.initialize, settings.coordinator_address, settings.num_processes, settings.process_id
        )
        if settings.process_id != 0:
            await follow(settings, ready=ready, stop=stop)
            return
    if settings.metrics_port:
        prometheus_client.start_http_server(settings.metrics_port, addr=settings.host)
        log.info("Prometheus metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)
    metrics.ADAPTER_SLOTS_TOTAL.set(settings.max_lora_adapters)
    name, local_path = resolve_base_model(settings)
    client = await connect(settings)
    restart = _cache_holds_programs(settings)
    first, later = warm_up_pieces(settings, warm_cache=restart)
    engine = await asyncio.to_thread(start_engine, settings, local_path, pieces=first)
    if restart and later:  # a surviving sampling client's first sample: its bucket read back before registering
        from tinkerflow.workers.engine.warm_up import first_sample_piece

        piece = first_sample_piece(warm_up_plan(settings), engine.slot_buckets)
        await asyncio.to_thread(engine.warm_up, (piece,), 1)
    log.info("JAX worker engine ready: %d warm-up pieces before registering, %d after", len(first), len(later))
    metrics.ADAPTER_PAGE_CAPACITY.set(engine.page_capacity)
    card = ModelCard(
        name=name,
        arch=engine.info.arch,
        local_path=str(engine.model_path),
        vocab_size=engine.info.vocab_size,
        max_context=engine.info.max_position_embeddings,
        image_processor=model_image_processor(engine.model_path),
    )
    worker_id = worker_id or stable_worker_id(settings)
    queue = names.worker_task_queue(name, settings.pool, worker_id)
    loop = asyncio.get_running_loop()

    def deliver(requester: str, result) -> concurrent.futures.Future:
        # Called from the engine thread: hand the signal to this process's event loop, do not wait for it here.
        return asyncio.run_coroutine_threadsafe(client.get_workflow_handle(requester).signal("deliver", result), loop)

    incarnation = uuid.uuid4().hex  # this process; a batch placed for an earlier one is refused (WorkerLost)
    activities = EngineActivities(
        engine,  # an EngineLock spells out every EngineApi call
        ClaimCheckStore(settings.resolved_store_url),
        deliver=deliver,
        checkpoints=CheckpointStore(settings.resolved_checkpoint_root),
        incarnation=incarnation,
        points=OpPoints(RunMetricsStore(settings.resolved_store_url, settings.run_metrics_max_points)),
        meter=AcceleratorMeter(getattr(engine, "config", None), settings.peak_tflops),
        images=wire_images.image_rules(card.image_processor, engine.info.image_token_id),
    )
    # One thread per batch held: the one running, the next waiting its turn (activities/batch_order.py).
    depth = min(settings.pipeline_depth, PIPELINE_DEPTH)
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=depth, thread_name_prefix="engine")
    worker = activity_worker(client, queue, activities.run_batch, executor, depth)
    async with worker:
        info = WorkerInfo(
            worker_id=worker_id,
            task_queue=queue,
            max_adapters=settings.max_lora_adapters,
            max_rank=settings.max_lora_rank,
            card=card,
            incarnation=incarnation,
            max_paged=engine.page_capacity,  # runs beyond the slots it can hold paged out
            pipeline_depth=depth,  # run_batch holds batches in dispatch order
        )
        await register(client, settings, info)
        log.info("JAX worker %s serving %s on queue %s", worker_id, name, queue)
        if settings.resolved_compilation_cache_dir is not None:
            from tinkerflow.workers.engine.runtime import persistent_cache

            c = persistent_cache.counts()
            log.info(
                "compilation cache %s: %d programs read back, %d compiled so far",
                settings.resolved_compilation_cache_dir,
                c.hits,
                c.misses,
            )
        if ready is not None:
            ready.set()
        reregister = asyncio.create_task(keep_registered(client, settings, info))
        if later:
            from tinkerflow.workers.engine.warm_up import split_by_slot_bucket

            later = split_by_slot_bucket(later, engine.slot_buckets)
        # What a first user needs (WarmUpPlan.first_user) back to back, the rest in traffic pauses.
        plan = warm_up_plan(settings)
        firsts = set(plan.pieces()[: plan.first_user()])
        urgent = sum(1 for p in later if p in firsts or dataclasses.replace(p, slots=0) in firsts)
        threads = settings.warm_up_threads
        background = asyncio.create_task(_warm_up_later(engine, later, threads, urgent, restart)) if later else None
        await (stop.wait() if stop is not None else asyncio.Event().wait())
        reregister.cancel()
        if background is not None:
            background.cancel()
    executor.shutdown(wait=False, cancel_futures=True)
    if multi_host:  # after the call in flight, if any (the driven engine serialises calls)
        driven = engine.engine  # inside the EngineLock
        assert isinstance(driven, multihost.DrivenEngine)
        await asyncio.to_thread(driven.stop_followers)


def _enable_compile_cache(settings: Settings) -> None:
    """Before anything compiles: programs this worker (or an earlier process of it) compiled are read back."""
    directory = settings.resolved_compilation_cache_dir
    if directory is not None:
        from tinkerflow.workers.engine.runtime import persistent_cache

        persistent_cache.enable(directory)


def activity_worker(
    client: Client, queue: str, run_batch, executor: concurrent.futures.Executor, depth: int = PIPELINE_DEPTH
) -> Worker:
    """The Temporal worker of this process's queue: the batch running and the next one, which waits its turn
    (activities/batch_order.py), each on a thread of `executor`.

    Every heartbeat the engine thread makes (each HEARTBEAT_EVERY_S, also inside one long compile) is sent to Temporal.
    By default the SDK throttles them to 0.8 x the activity's heartbeat timeout, 12 s of the coordinator's 15 s: only
    3 s of slack, which a loaded dev server eats (docs/benchmarks.md §Measurements behind the code), so the
    batch times out and the worker is taken for dead in the middle of a first compile. Sent every
    5 s, three heartbeats fall in each timeout window and any one of them keeps the batch alive."""
    from tinkerflow.activities.engine_activities import HEARTBEAT_EVERY_S

    return Worker(
        client,
        task_queue=queue,
        activities=[run_batch],
        activity_executor=executor,
        max_concurrent_activities=depth,
        max_heartbeat_throttle_interval=timedelta(seconds=HEARTBEAT_EVERY_S),
    )


def warm_up_plan(settings: Settings) -> WarmUpPlan:
    return WarmUpPlan(
        train=TrainWarmUp(rows=settings.warm_up_train_rows, seq_lens=settings.warm_up_train_lens),
        sampler=SamplerWarmUp(
            num_adapters=settings.warm_up_sampler_stacks,
            scoring=(False, True) if settings.warm_up_scoring else (False,),
        ),
    )


def warm_up_pieces(
    settings: Settings, *, warm_cache: bool = False
) -> tuple[tuple[WarmUpPiece, ...], tuple[WarmUpPiece, ...]]:
    """(the pieces to run before registering, those to run after, in the background), as `--warm-up` says; both
    in the order a first user needs them (WarmUpPlan.pieces). With `background`: the adapter lifecycle before
    registering (its training half, then its sampling half, whose sample builds the slot bucket a first sample
    uses), the rest after, each compiled from shapes beside the traffic where it can be (warm_up.compile_ahead).
    `warm_cache`: the persistent compilation cache already holds programs (a restart): everything is read back in
    the background (serve reads the first sample's slot bucket back before registering, `first_sample_piece`). Read
    back before registering, the lifecycle would delay a killed worker's recovery by as long as it takes, while a
    recovery's own ops need only a few of its programs (docs/benchmarks.md §Measurements behind the code)."""
    if settings.warm_up == "off":
        return (), ()
    pieces = warm_up_plan(settings).pieces()
    if settings.warm_up == "ready":
        return pieces, ()
    if warm_cache:
        return (), pieces
    first = tuple(p for p in pieces if p.kind in ("lifecycle", "lifecycle_sample"))
    return first, tuple(p for p in pieces if p not in first)


def _cache_holds_programs(settings: Settings) -> bool:
    directory = settings.resolved_compilation_cache_dir
    return directory is not None and directory.is_dir() and any(directory.iterdir())


def start_engine(settings: Settings, local_path: str, *, pieces: tuple[WarmUpPiece, ...] | None = None) -> EngineLock:
    """Process 0's engine, ready for work: loaded, driven when the worker spans several processes (every engine call
    is replayed by the others first, multihost.py), its buckets rounded up to the warm-up's, warmed up with `pieces`
    (default: what `--warm-up` runs before registering; on every process: the warm-up is an engine call like any
    other), and behind its lock (engine_lock.EngineLock) so a background warm-up can share it with the activities."""
    from tinkerflow.workers.engine.engine_lock import EngineLock

    engine = load_engine(settings, local_path)
    if settings.num_processes > 1:
        from tinkerflow.workers.engine import multihost

        engine = multihost.DrivenEngine(engine)
    plan = warm_up_plan(settings)
    if settings.warm_up != "off":
        engine.prefer_buckets(plan)
    if settings.warm_up == "background":  # its first sampler family: a first sample compiles only its own bucket
        engine.schedule_warm_up(plan.pieces()[: plan.first_user()])
    if pieces is None:
        pieces = warm_up_pieces(settings)[0]
    if pieces:
        engine.warm_up(pieces, settings.warm_up_threads)
    return EngineLock(engine)


async def _warm_up_later(
    engine, pieces: tuple[WarmUpPiece, ...], threads: int = 1, urgent: int = 1, restart: bool = False
) -> None:
    """The background warm-up: one piece at a time on a thread of its own (train buckets on `threads`), each under
    the engine's lock but train buckets and sampler families (they only compile, from shapes, beside the traffic: a
    request never waits for one of them, only for a compile of a program it needs itself). The first `urgent` pieces
    back to back from the start (what a first user needs next: a request that comes meanwhile takes the lock between
    two pieces), each later one once the engine has been idle for WARM_UP_AFTER_IDLE_S (requests come first).
    `restart`: the first piece waits for the recovery the coordinator may send (a request served and a pause, or
    WARM_UP_AFTER_RESTART_S without any): reading a program back costs about as much CPU as the recovery has, so
    read back at once even the train buckets alone would double it (docs/benchmarks.md §Measurements behind the
    code)."""
    built, gate = 0, restart
    for i, piece in enumerate(pieces):
        while True:
            idle = engine.idle_seconds()
            if gate:
                if idle >= WARM_UP_AFTER_IDLE_S and (engine.calls > 0 or idle >= WARM_UP_AFTER_RESTART_S):
                    break
            elif i < urgent or idle >= WARM_UP_AFTER_IDLE_S:
                break
            await asyncio.sleep(WARM_UP_AFTER_IDLE_S / 4)
        gate = False
        # A train bucket only compiles: beside the traffic, not in its way; the other pieces run programs, in turn.
        call = engine.compile_ahead if piece.kind in COMPILE_ONLY_KINDS else engine.warm_up
        try:
            built += await asyncio.to_thread(call, (piece,), threads)
        except Exception:  # a warm-up that fails costs a compile later, never the worker
            log.exception("background warm-up of %s failed", piece)
    log.info("background warm-up done: %d pieces, %d programs built", len(pieces), built)


def keep_torch_out() -> None:
    """Make `import torch` fail in this process (before anything imports it). The tinker SDK's types and transformers
    import torch when it is installed (the parity extra installs it), which adds seconds to every JAX worker start;
    neither needs it here: transformers then serves the tokenizer alone. For the worker's own process only (the CLI
    calls it), never where tests or parity code run in the same interpreter."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # pyright: ignore[reportArgumentType]  (None: Python's "not importable")


def load_engine(settings: Settings, local_path: str):
    """The engine on the mesh the settings ask for; with several processes the mesh spans all their devices."""
    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.model.sharding import MeshConfig

    host_memory.bound_programs(settings.max_programs, settings.program_memory_mb * 2**20)  # before anything compiles
    mesh = MeshConfig(fsdp=settings.mesh_fsdp or None, tp=settings.mesh_tp, ep=settings.mesh_ep)
    engine = Engine.load(
        local_path,
        max_lora_adapters=settings.max_lora_adapters,
        max_lora_rank=settings.max_lora_rank,
        mesh=mesh,
        snapshot_budget_bytes=settings.snapshot_budget_mb * 2**20,
        device_memory_bytes=int(settings.device_memory_gb * 2**30),
        prefix_cache_tokens=settings.prefix_cache_tokens,
        decode_layers=settings.decode_layers,
        page_store=page_store(settings),
        random_weights=settings.random_weights,
    )
    publish_memory_plan(engine.memory)
    return engine


def page_store(settings: Settings):
    """Where this process keeps the adapters it pages out: host memory, then files in the checkpoint store under
    `.paging/<worker id>-<process>/`, emptied at start (a restarted worker's Coordinator forgot what is there)."""
    from tinkerflow.workers.engine.runtime.paging_store import PageStore, default_host_budget_bytes

    host = settings.adapter_host_memory_mb * 2**20 or default_host_budget_bytes(int(settings.device_memory_gb * 2**30))
    root = settings.resolved_checkpoint_root.rstrip("/")
    spill = f"{root}/.paging/{stable_worker_id(settings)}-{settings.process_id}"
    return PageStore(host, settings.adapter_disk_mb * 2**20, spill_url=spill if settings.adapter_disk_mb else "")


async def follow(settings: Settings, ready: asyncio.Event | None = None, stop: asyncio.Event | None = None) -> None:
    """A multi-host worker's process > 0: load the same engine, then replay process 0's engine calls until it says
    stop (or `stop` is set). Never connects to Temporal."""
    import threading

    from tinkerflow.workers.engine import multihost

    _, local_path = resolve_base_model(settings)
    engine = await asyncio.to_thread(load_engine, settings, local_path)
    log.info("JAX worker process %d of %d following process 0", settings.process_id, settings.num_processes)
    if ready is not None:
        ready.set()
    halt = threading.Event()
    replay = asyncio.ensure_future(asyncio.to_thread(multihost.follow, engine, None, halt))
    waits = {replay} | ({asyncio.ensure_future(stop.wait())} if stop is not None else set())
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending - {replay}:
        task.cancel()
    if replay not in done:
        halt.set()  # stopped from here (SIGTERM): the loop notices within one poll
    await replay
