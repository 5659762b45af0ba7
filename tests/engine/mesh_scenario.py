"""One training + sampling scenario run on several meshes in a fresh process with N CPU devices.

JAX fixes its device count when the backend starts, so the sharding tests run this file in a subprocess:

    python tests/engine/mesh_scenario.py MODEL_DIR OUT.npz --devices 2 --meshes 1x1,2x1,1x2 [--options ...]

Each mesh ("FSDPxTP", or "FSDPxTPxEP" with an expert-parallel axis for MoE models) gets its own engine on the same
checkpoint; the arrays it produced are saved under
"<mesh>/<name>" in OUT.npz for the test to compare. `--expect-error FSDPxTP` instead loads on that mesh and prints
the ValueError (exit 3 when none was raised).
"""

from __future__ import annotations

import argparse
import os
import sys

# As the test session's engine (conftest), so a scenario run in-process there is directly comparable.
MAX_ADAPTERS, MAX_RANK = 4, 8
SAMPLE_SLOTS = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out", nargs="?")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--meshes", default="1x1,2x1,1x2")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--expect-error", help="FSDPxTP: first check that loading on this mesh raises ValueError")
    parser.add_argument("--quick", action="store_true", help="skip the forward-only pass and the seeded samples")
    parser.add_argument(
        "--fast-compile",
        action="store_true",
        help="LLVM without its expensive passes, for every mesh alike: about a third less compile time "
        "on CPU; what is compared (the partitioned programs' numbers) does not depend on it",
    )
    args = parser.parse_args()

    flags = f" --xla_force_host_platform_device_count={args.devices}"
    if args.fast_compile:
        flags += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + flags).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    assert len(jax.devices()) == args.devices, jax.devices()

    from tinkerflow.workers.engine.engine import Engine
    from tinkerflow.workers.engine.model.sharding import MeshConfig

    if args.expect_error:
        model_dir, mesh = args.expect_error.split(":")
        fsdp, tp = map(int, mesh.split("x"))
        try:
            Engine.load(
                model_dir,
                max_lora_adapters=MAX_ADAPTERS,
                max_lora_rank=MAX_RANK,
                progress=False,
                mesh=MeshConfig(fsdp=fsdp, tp=tp),
            )
        except ValueError as e:
            print(f"ValueError: {e}", flush=True)
        else:
            sys.exit(3)

    import numpy as np

    results: dict[str, np.ndarray] = {}
    for spec in args.meshes.split(","):
        fsdp, tp, ep = (list(map(int, spec.split("x"))) + [1])[:3]  # "FSDPxTP" or "FSDPxTPxEP" (MoE models)
        engine = Engine.load(
            args.model_dir,
            max_lora_adapters=MAX_ADAPTERS,
            max_lora_rank=MAX_RANK,
            progress=False,
            mesh=MeshConfig(fsdp=fsdp, tp=tp, ep=ep),
            gradient_checkpointing=args.gradient_checkpointing,
        )
        want = {"fsdp": fsdp, "tp": tp, **({"ep": ep} if ep > 1 else {})}
        assert dict(engine.mesh.shape) == want, engine.mesh.shape
        for name, arr in run(engine, quick=args.quick).items():
            results[f"{spec}/{name}"] = arr
    np.savez(args.out, **results)  # pyright: ignore[reportArgumentType] (numpy's savez stubs)


def run(engine, quick: bool = False) -> dict:
    """Two adapters in one batch, a step, forward again, then greedy and seeded sampling of a snapshot.

    Uses slots 0 and 1 and the snapshot key "mesh-scenario" (dropped at the end)."""
    import numpy as np

    from tinkerflow.workers.engine.types import (
        AdamConfig,
        Datum,
        ForwardBackwardInput,
        LoraConfig,
        SampleInput,
    )

    rng = np.random.default_rng(0)
    engine.create_adapter(0, LoraConfig(rank=4, seed=1))
    engine.create_adapter(1, LoraConfig(rank=2, seed=2))

    def ce(slot, lengths, forward_only=False):
        data = []
        for n in lengths:
            s = rng.integers(1, 300, n + 1).astype(np.int32)
            data.append(Datum(tokens=s[:-1], inputs={"target_tokens": s[1:]}))
        return ForwardBackwardInput(slot=slot, data=data, loss_fn="cross_entropy", forward_only=forward_only)

    out = {}
    reqs = [ce(0, [11, 7]), ce(1, [9])]  # three rows: the row bucket (4) splits on fsdp=2
    res = engine.forward_backward(reqs)
    out["fb_loss"] = np.array([r.metrics["loss:sum"] for r in res])
    out["fb_logprobs"] = np.concatenate([o["logprobs"] for r in res for o in r.outputs])
    for slot in (0, 1):
        for k, v in engine.accumulated_grads(slot).items():
            out[f"grad{slot}/{k}"] = v
    out["grad_norm"] = np.array([engine.optim_step(0, AdamConfig(learning_rate=1e-2, weight_decay=0.1))["grad_norm"]])
    for k, v in engine.adapter_weights(0).items():
        out[f"weights0/{k}"] = v
    if not quick:
        [after] = engine.forward_backward([ce(0, [13], forward_only=True)])
        out["after_logprobs"] = after.outputs[0]["logprobs"]
    engine.snapshot(0, "mesh-scenario")
    prompt = np.array([5, 17, 42, 99, 3, 250, 7], np.int32)
    requests = [
        SampleInput(
            prompt=prompt,
            max_tokens=8,
            temperature=0.0,
            stop_token_ids=[],
            snapshot="mesh-scenario",
            include_prompt_logprobs=True,
        )
    ]
    if not quick:
        requests.append(SampleInput(prompt=prompt[:4], num_samples=2, max_tokens=6, seed=3, stop_token_ids=[]))
    # One decode-slot bucket (8 fits every request here) instead of compiling all three eagerly: each compile is a
    # decode chunk and an admission program per mesh, the bulk of this scenario's time on a loaded CPU.
    slots, engine.sample_slots = engine.sample_slots, SAMPLE_SLOTS
    try:
        results = engine.sample(requests)
    finally:
        engine.sample_slots = slots
    engine.drop_snapshot("mesh-scenario")
    greedy = results[0]
    out["greedy_tokens"] = np.array(greedy.sequences[0].tokens)
    out["greedy_logprobs"] = np.array(greedy.sequences[0].logprobs)
    out["prompt_logprobs"] = np.array(greedy.prompt_logprobs[1:])
    if not quick:
        out["seeded_tokens"] = np.array([s.tokens for s in results[1].sequences])
        out["seeded_logprobs"] = np.array([s.logprobs for s in results[1].sequences])
    return out


if __name__ == "__main__":
    main()
