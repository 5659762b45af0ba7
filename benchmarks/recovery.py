"""How long a run is stalled when its JAX worker dies (docs/architecture.md §What durability promises); one JSON line
per figure.

Starts a stack with two JAX workers (each part its own process, as `tinkerflow up` does), trains a run a few steps,
then `kill -9`s the worker holding it with a forward_backward in flight, and times until that future is answered:

- mode "survivor": the worker stays dead; the run is restored on the other worker (heartbeat timeout + re-place +
  snapshot load + replay);
- mode "restart": the worker is started again at once; its new process re-registers and the run is restored on it.
  Beside it, the engine alone doing the same in a fresh process (the floor a restart can reach): start the
  interpreter, Engine.load with the same compilation cache, create the adapter, replay the ops since the snapshot and
  run the answered op. Emitted as the table's `recovery_kill_to_next_answer_s` (target: ≤ 8 s).

    python -m benchmarks.recovery                  # tiny model, snapshot every 10 steps, 3 steps before the kill
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import emit, emit_pair


def measure(mode: str, steps: int, snapshot_every: int) -> dict:
    import tinker
    from temporalio.client import Client
    from tinker import types

    from tinkerflow.cli.launch import free_port
    from tinkerflow.cli.up import Stack
    from tinkerflow.common.settings import Settings

    datum = types.Datum(
        model_input=types.ModelInput.from_ints([10, 20, 30, 40]),
        loss_fn_inputs=dict(target_tokens=[20, 30, 40, 50], weights=[1.0] * 4),  # pyright: ignore[reportArgumentType] (Datum converts lists)
    )
    adam = types.AdamParams(learning_rate=1e-3)
    temporal_port = free_port()
    settings = Settings(
        state_dir=Path(tempfile.mkdtemp(prefix="tinkerflow-bench-recovery-")),
        port=free_port(),
        api_keys=("tml-bench",),
        temporal_address=f"127.0.0.1:{temporal_port}",
        max_lora_adapters=2,
        auto_snapshot_every=snapshot_every,
    )
    stack = Stack(settings)
    try:
        stack.start_temporal(temporal_port, 0, headless=True)
        stack.start_worker("workflow-worker")
        for n in (1, 2):
            stack.start_worker("jax-worker", "--worker-id", f"w{n}", name=f"jax-worker-{n}")
        stack.start_api()
        model = stack.served_model()
        service = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
        training = service.create_lora_training_client(base_model=model, rank=8).result()
        for _ in range(steps):
            training.forward_backward([datum], "cross_entropy").result(timeout=600)
            training.optim_step(adam).result(timeout=600)

        async def describe() -> dict:
            client = await Client.connect(settings.temporal_address)
            return await client.get_workflow_handle(f"coordinator/{model}/default").query("describe")

        described = asyncio.run(describe())
        queue, _slot = described["placements"][training.model_id]
        worker_id = described["workers"][queue]["worker_id"]
        pending = training.forward_backward([datum], "cross_entropy")
        killed = time.perf_counter()
        stack.kill(f"jax-worker-{worker_id[1:]}")
        if mode == "restart":
            stack.start_worker("jax-worker", "--worker-id", worker_id, name=f"jax-worker-{worker_id[1:]}")
        pending.result(timeout=900)
        return {
            "seconds_to_answer": round(time.perf_counter() - killed, 2),
            "ops_replayed": 2 * (steps % snapshot_every),
            "model_dir": training.get_info().model_data.tokenizer_id,
            "cache_dir": str(settings.resolved_compilation_cache_dir or ""),
        }
    finally:
        stack.stop()


def engine_child(model_dir: str, cache_dir: str, ops_replayed: int) -> None:
    """In a fresh process (a restarted worker's floor): load, create the adapter, replay, answer the op."""
    import numpy as np

    from tinkerflow.workers.engine.runtime import persistent_cache

    if cache_dir:
        persistent_cache.enable(Path(cache_dir))
    from tinkerflow.common.settings import Settings
    from tinkerflow.workers.engine.types import AdamConfig, Datum, ForwardBackwardInput, LoraConfig
    from tinkerflow.workers.jax_worker import load_engine, warm_up_plan

    # Loaded as the stack's worker loads it (same adapter slots, buckets rounded up to the warm-up's), so the same
    # programs are read back from the same cache.
    settings = Settings(max_lora_adapters=2, state_dir=Path(tempfile.mkdtemp(prefix="tinkerflow-bench-engine-")))
    engine = load_engine(settings, model_dir)
    engine.prefer_buckets(warm_up_plan(settings))
    engine.create_adapter(0, LoraConfig(rank=8, seed=0))
    tokens = np.asarray([10, 20, 30, 40], np.int32)
    inputs = {"target_tokens": np.asarray([20, 30, 40, 50], np.int32), "weights": np.ones(4, np.float32)}
    fwd = ForwardBackwardInput(0, [Datum(tokens=tokens, inputs=inputs)], "cross_entropy")
    for _ in range(ops_replayed // 2):
        engine.forward_backward([fwd])
        engine.optim_step(0, AdamConfig(learning_rate=1e-3))
    engine.forward_backward([fwd])
    print(json.dumps({"answered": True}), flush=True)


def engine_restart_s(model_dir: str, cache_dir: str, ops_replayed: int) -> float:
    """Wall time from spawning the engine-alone child to its answer (interpreter start and imports included, as for
    the restarted worker)."""
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "benchmarks.recovery", "--engine-child", model_dir, cache_dir, str(ops_replayed)],
        capture_output=True,
        text=True,
        check=True,
    )
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--mode",
        choices=["survivor", "restart"],
        action="append",
        help="which recovery to time (repeatable; default both)",
    )
    parser.add_argument("--steps", type=int, default=3, help="training steps before the kill (default 3)")
    parser.add_argument("--snapshot-every", type=int, default=10, help="--auto-snapshot-every (default 10)")
    parser.add_argument("--engine-child", nargs=3, metavar=("MODEL_DIR", "CACHE_DIR", "OPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_child:
        engine_child(args.engine_child[0], args.engine_child[1], int(args.engine_child[2]))
        return
    for mode in args.mode or ["survivor", "restart"]:
        got = measure(mode, args.steps, args.snapshot_every)
        model_dir, cache_dir = got.pop("model_dir"), got.pop("cache_dir")
        emit(
            figure="recovery_after_worker_kill",
            mode=mode,
            steps_before_kill=args.steps,
            snapshot_every=args.snapshot_every,
            **got,
        )
        if mode == "restart" and model_dir:
            emit_pair(
                "recovery_kill_to_next_answer_s",
                "s",
                got["seconds_to_answer"],
                engine_restart_s(model_dir, cache_dir, got["ops_replayed"]),
                ops_replayed=got["ops_replayed"],
            )


if __name__ == "__main__":
    main()
