"""Process 0 of a 2-process CPU JAX worker, driving the engine through `multihost.DrivenEngine`
(test_multihost_processes.py).

    python tests/engine/multihost_scenario.py MODEL_DIR HOST:PORT OUT.json [--num-processes 2] [--mesh-fsdp 2]

It joins jax.distributed as process 0, loads the engine on a mesh over every process's devices, runs `run` through
the driven engine, tells the followers to stop and writes the results as JSON to OUT.json. The other processes are
real `tinkerflow jax-worker --process-id I` followers. `run` is also what the test runs on its 1-device engine.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

# As the test session's engine (conftest) and the followers' flags, so all of them load the same engine.
MAX_ADAPTERS, MAX_RANK = 4, 8
SAMPLE_SLOTS = 8
LEARNING_RATE = 1e-2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("coordinator")
    parser.add_argument("out")
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--mesh-fsdp", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s leader %(name)s: %(message)s")
    t0 = time.perf_counter()

    from tinkerflow.workers.engine import multihost

    multihost.initialize(args.coordinator, args.num_processes, 0, initialization_timeout_s=120)
    import jax

    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.model.sharding import MeshConfig

    engine = Engine.load(
        args.model_dir,
        max_lora_adapters=MAX_ADAPTERS,
        max_lora_rank=MAX_RANK,
        progress=False,
        mesh=MeshConfig(fsdp=args.mesh_fsdp, tp=1),
    )
    processes = sorted({d.process_index for d in engine.mesh.devices.flat})
    assert processes == list(range(args.num_processes)), f"the mesh does not span every process: {processes}"
    driven = multihost.DrivenEngine(engine)
    loaded = time.perf_counter() - t0
    results = run(driven)
    results["seedless_adapter_agrees"] = seedless_adapter_agrees(driven)
    driven.stop_followers()
    results["timing"] = {"load_s": loaded, "total_s": time.perf_counter() - t0}
    results["mesh"] = dict(engine.mesh.shape)
    results["process_count"] = jax.process_count()
    with open(args.out, "w") as f:
        json.dump(results, f)
    print(json.dumps({"timing": results["timing"], "mesh": results["mesh"]}), flush=True)


def run(engine) -> dict:
    """Two adapters in one batch, two forward_backward + optim_step rounds, the trained weights, a rejected call,
    then greedy and seeded sampling of a snapshot. JSON-friendly lists out. Slots 0 and 1, snapshot "multihost"."""
    import numpy as np

    rng = np.random.default_rng(0)
    slots, engine.sample_slots = engine.sample_slots, SAMPLE_SLOTS  # one decode bucket to compile, not three
    try:
        return _run(engine, rng)
    finally:
        engine.sample_slots = slots


def _run(engine, rng) -> dict:
    import numpy as np

    from tinkerflow.workers.engine.types import (
        AdamConfig,
        Datum,
        ForwardBackwardInput,
        InputError,
        LoraConfig,
        SampleInput,
    )

    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    engine.create_adapter(1, LoraConfig(rank=2, seed=2))

    def ce(slot, lengths):
        data = []
        for n in lengths:
            s = rng.integers(1, 300, n + 1).astype(np.int32)
            data.append(Datum(tokens=s[:-1], inputs={"target_tokens": s[1:]}))
        return ForwardBackwardInput(slot=slot, data=data, loss_fn="cross_entropy")

    out: dict = {"loss": [], "logprobs": [], "grad_norm": []}
    for _ in range(2):
        res = engine.forward_backward([ce(0, [11, 7]), ce(1, [9])])  # 3 rows: the row bucket (4) splits on fsdp
        out["loss"] += [r.metrics["loss:sum"] for r in res]
        out["logprobs"] += [float(x) for r in res for o in r.outputs for x in o["logprobs"]]
        for slot in (0, 1):
            step = engine.optim_step(slot, AdamConfig(learning_rate=LEARNING_RATE, weight_decay=0.1))
            out["grad_norm"].append(step["grad_norm"])
    out["weights0"] = {k: v.ravel().tolist() for k, v in sorted(engine.adapter_weights(0).items())}
    try:  # a bad call fails on every process alike, and they stay in step
        engine.create_adapter(0, LoraConfig(rank=MAX_RANK + 1))
        out["rejected"] = None
    except InputError as e:
        out["rejected"] = str(e)
    engine.snapshot(0, "multihost")
    prompt = np.array([5, 17, 42, 99, 3, 250, 7], np.int32)
    greedy, seeded = engine.sample(
        [
            SampleInput(
                prompt=prompt,
                max_tokens=8,
                temperature=0.0,
                stop_token_ids=[],
                snapshot="multihost",
                include_prompt_logprobs=True,
            ),
            SampleInput(
                prompt=prompt[:4],
                max_tokens=6,
                seed=3,
                stop_token_ids=[],
                snapshot="multihost",
                include_prompt_logprobs=True,
            ),  # one admission family (prompt logprobs on) to compile
        ]
    )
    engine.drop_snapshot("multihost")
    out["greedy_tokens"] = greedy.sequences[0].tokens
    out["greedy_logprobs"] = greedy.sequences[0].logprobs
    out["prompt_logprobs"] = greedy.prompt_logprobs[1:]
    out["seeded_tokens"] = [s.tokens for s in seeded.sequences]
    out["seeded_logprobs"] = [s.logprobs for s in seeded.sequences]
    return out


def seedless_adapter_agrees(driven) -> bool:
    """An adapter created without a seed gets one on the leader: its A (split across the processes) equals that of
    an adapter created with the seed the leader drew, which it would not if each process had drawn its own."""
    import numpy as np

    from tinkerflow.workers.engine.types import LoraConfig

    driven.create_adapter(2, LoraConfig(rank=4))
    drawn = driven.engine.adapters.configs[2].seed
    driven.create_adapter(3, LoraConfig(rank=4, seed=drawn))
    a, b = driven.adapter_weights(2), driven.adapter_weights(3)
    return drawn is not None and all(np.array_equal(a[k], b[k]) for k in a)


if __name__ == "__main__":
    sys.exit(main())
