"""Temporal history written per op, and what the disk holds per million ops; one JSON line per figure.

Runs a training loop as RL and SFT clients do (forward_backward, optim_step, save_weights_and_get_sampling_client,
sample) against `tinkerflow up` on the tiny model, then sums the history of every workflow execution it caused
(serialized history events, as the server stores them), the growth of the dev server's SQLite file and of the
claim-check store (request bodies and results, kept --store-retention-s).

    python -m benchmarks.history_bytes                 # 20 iterations
    python -m benchmarks.history_bytes --iterations 50
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from benchmarks.common import emit

OPS_PER_ITERATION = 4  # forward_backward, optim_step, save_weights_and_get_sampling_client, sample


async def history_bytes(address: str) -> tuple[int, int, int]:
    """(bytes, events, executions) over every workflow execution in the namespace."""
    from temporalio.client import Client

    client = await Client.connect(address)
    total = events = executions = 0
    async for wf in client.list_workflows():
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        total += sum(e.ByteSize() for e in history.events)
        events += len(history.events)
        executions += 1
    return total, events, executions


def _db_bytes(state: Path) -> int:
    return sum(p.stat().st_size for p in state.glob("temporal.db*"))


def _store_bytes(state: Path) -> int:
    return sum(p.stat().st_size for p in (state / "store").rglob("*") if p.is_file())


def measure(iterations: int) -> dict:
    import tinker
    from tinker import types

    from tinkerflow.cli.launch import launch

    state = Path(tempfile.mkdtemp(prefix="tinkerflow-bench-history-")) / "state"
    stack = launch(state, api_key="tml-bench-history")
    try:
        service = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
        training = service.create_lora_training_client(base_model=stack.served_model(), rank=8).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([10, 20, 30, 40, 50, 60, 70, 80]),
            loss_fn_inputs=dict(target_tokens=[20, 30, 40, 50, 60, 70, 80, 90], weights=[1.0] * 8),  # pyright: ignore[reportArgumentType] (Datum converts lists)
        )
        bytes0, events0, _ = asyncio.run(history_bytes(stack.temporal_address))
        db0, store0 = _db_bytes(state), _store_bytes(state)
        for _ in range(iterations):
            training.forward_backward([datum], "cross_entropy").result(timeout=600)
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=600)
            sampler = training.save_weights_and_get_sampling_client().result()
            sampler.sample(types.ModelInput.from_ints([10, 20]), 1, types.SamplingParams(max_tokens=8)).result(
                timeout=600
            )
        total, events, executions = asyncio.run(history_bytes(stack.temporal_address))
        ops = iterations * OPS_PER_ITERATION
        per_op = (total - bytes0) / ops
        db_per_op = (_db_bytes(state) - db0) / ops
        store_per_op = (_store_bytes(state) - store0) / ops
        return {
            "iterations": iterations,
            "ops": ops,
            "executions": executions,
            "history_bytes_per_op": round(per_op),
            "history_events_per_op": round((events - events0) / ops, 1),
            "sqlite_bytes_per_op": round(db_per_op),
            "sqlite_gb_per_million_ops": round(db_per_op * 1e6 / 1e9, 2),
            "store_bytes_per_op": round(store_per_op),
            "store_gb_per_million_ops": round(store_per_op * 1e6 / 1e9, 2),
        }
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20, help="loop iterations (4 ops each; default 20)")
    args = parser.parse_args()
    emit(figure="temporal_history_per_op", **measure(args.iterations))


if __name__ == "__main__":
    main()
