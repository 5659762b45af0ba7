"""Record the workflow histories of real runs into tests/replay/histories/ (the replay suite's input).

    .venv/bin/python -m tests.replay.record            # a few minutes on a laptop CPU; rewrites the directory
    .venv/bin/python -m tests.replay.record --add v2   # keeps the files there, adds <WorkflowType>-v2-<n>.json
    .venv/bin/python -m tests.replay.record --add paging --paging   # more runs than slots, added beside them
    .venv/bin/python -m tests.replay.record --add pipeline --pipeline   # runs stepping at once: batches pipelined
    .venv/bin/python -m tests.replay.record --add samplers --sampler-restart   # samples in flight when a worker dies

Brings up `tinkerflow up` (tiny model) and drives it with the unmodified SDK through what the workflows do in
production: training (forward_backward, optim_step), sampling, checkpoints (save_state, a load into a new client,
sampler weights with a TTL), a JAX worker killed mid-step and restored (recovery), and a session that stops
heartbeating and times out. Then it writes every workflow execution's history as JSON (the format of
`temporal workflow show --output json`), one file per execution, named `<WorkflowType>-<n>.json`.

Re-record when a scenario is added, never to make a failing replay pass: a replay failure means the workflow code
changed in a way running workflows cannot follow (see workflows/README.md).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE / "histories"
API_KEY = "tml-replay"


def _client(stack):
    """The SDK's ServiceClient on the stack, the served model's name, and the one datum and Adam step every
    scenario trains with."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=stack.base_url, api_key=stack.api_key)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([10, 20, 30, 40]),
        loss_fn_inputs=dict(target_tokens=[20, 30, 40, 50], weights=[1.0] * 4),  # pyright: ignore[reportArgumentType] (Datum converts lists)
    )
    return service, stack.served_model(), datum, types.AdamParams(learning_rate=1e-3)


def drive(stack) -> None:
    import httpx
    from tinker import types

    service, model, datum, adam = _client(stack)

    # training + sampling
    training = service.create_lora_training_client(base_model=model, rank=4, seed=3).result()
    for _ in range(3):
        training.forward_backward([datum], "cross_entropy").result(timeout=600)
        training.optim_step(adam).result(timeout=600)
    sampler = training.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints([10, 20]), 2, types.SamplingParams(max_tokens=4, seed=1)).result(
        timeout=600
    )

    # checkpoints: training state saved and loaded into a new client; sampler weights with a TTL
    state = training.save_state("replay-state").result(timeout=600).path
    loaded = service.create_training_client_from_state_with_optimizer(state).result(timeout=600)
    loaded.forward_backward([datum], "cross_entropy").result(timeout=600)
    weights = training.save_weights_for_sampler("replay-weights", ttl_seconds=3600).result(timeout=600).path
    service.create_sampling_client(model_path=weights).sample(
        types.ModelInput.from_ints([10]), 1, types.SamplingParams(max_tokens=2)
    ).result(timeout=600)

    # recovery: the JAX worker dies with a step in flight; `up` restarts it and the run restores itself
    pending = training.forward_backward([datum], "cross_entropy")
    old = stack.kill_part("jax-worker")
    stack.wait_restarted("jax-worker", old)
    pending.result(timeout=900)
    training.optim_step(adam).result(timeout=900)

    # session timeout: a session that never heartbeats (what a crashed client leaves behind)
    # (20 s: the SDK's own sessions heartbeat every 10 s and must outlive it)
    http = httpx.Client(base_url=stack.base_url, headers={"X-API-Key": stack.api_key}, timeout=60)
    abandoned = http.post(
        "/api/v1/create_session",
        json={"tags": ["abandoned"], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"},
    ).json()
    asyncio.run(_wait_closed(stack.temporal_address, f"session/{abandoned['session_id']}"))


def drive_paging(stack) -> None:
    """More runs than slots (a stack with 2 adapter slots): runs trained round-robin so every step pages, a sampler
    of a paged-out run, a create refused past the tenant's live-run limit, a run ended while paged out, and the JAX
    worker killed with runs paged out, every run restoring itself."""
    import tinker
    from tinker import types

    service, model, datum, adam = _client(stack)
    runs = [service.create_lora_training_client(base_model=model, rank=4, seed=n).result() for n in range(5)]
    for _ in range(2):
        for training in runs:
            training.forward_backward([datum], "cross_entropy").result(timeout=600)
            training.optim_step(adam).result(timeout=600)
    sampler = runs[0].save_weights_and_get_sampling_client().result()  # runs[0] was paged out: paged back in
    sampler.sample(types.ModelInput.from_ints([10, 20]), 1, types.SamplingParams(max_tokens=4, seed=1)).result(
        timeout=600
    )
    try:
        service.create_lora_training_client(base_model=model, rank=4).result(timeout=600)
        raise AssertionError("a sixth run was created past --max-live-runs-per-tenant 5")
    except tinker.RequestFailedError:
        pass
    old = stack.kill_part("jax-worker")
    stack.wait_restarted("jax-worker", old)
    for training in runs:
        training.forward_backward([datum], "cross_entropy").result(timeout=900)
        training.optim_step(adam).result(timeout=900)


def drive_pipeline(stack) -> None:
    """Several runs training at once, each step sent for all of them before any answer is awaited: the Coordinator
    queues the JAX worker's next batch while one runs (pipelined dispatch). Then the worker is killed with steps in
    flight, and every run restores itself."""

    service, model, datum, adam = _client(stack)
    runs = [service.create_lora_training_client(base_model=model, rank=4, seed=n).result() for n in range(4)]
    for _ in range(3):
        for step in ([t.forward_backward([datum], "cross_entropy") for t in runs], [t.optim_step(adam) for t in runs]):
            for future in step:
                future.result(timeout=600)
    pending = [t.forward_backward([datum], "cross_entropy") for t in runs]
    old = stack.kill_part("jax-worker")
    stack.wait_restarted("jax-worker", old)
    for future in pending:
        future.result(timeout=900)
    for future in [t.optim_step(adam) for t in runs]:
        future.result(timeout=900)


def drive_sampler_restart(stack) -> None:
    """Ephemeral, named and base-model sampling clients with samples in flight when the JAX worker is killed: the
    lost calls are sent again and the ephemeral snapshot is loaded on the successor from its copy."""
    from tinker import types

    service, model, datum, adam = _client(stack)
    training = service.create_lora_training_client(base_model=model, rank=4, seed=5).result()
    training.forward_backward([datum], "cross_entropy").result(timeout=600)
    training.optim_step(adam).result(timeout=600)
    path = training.save_weights_for_sampler(name="replay").result(timeout=600).path
    clients = [
        training.save_weights_and_get_sampling_client().result(timeout=600),
        service.create_sampling_client(model_path=path),
        service.create_sampling_client(base_model=model),
    ]
    prompt, params = types.ModelInput.from_ints([10, 20]), types.SamplingParams(max_tokens=4, seed=1)
    for c in clients:
        c.sample(prompt, 1, params).result(timeout=600)
    pending = [c.sample(prompt, 1, params) for c in clients for _ in range(3)]
    old = stack.kill_part("jax-worker")
    stack.wait_restarted("jax-worker", old)
    for future in pending + [c.sample(prompt, 1, params) for c in clients]:
        future.result(timeout=900)


def patches_marked(path: Path) -> set[str]:
    """The patch ids a recorded history's markers hold."""
    import base64

    events = json.loads(path.read_text())["history"]["events"]
    found = set()
    for e in events:
        details = e.get("markerRecordedEventAttributes", {}).get("details", {})
        for payload in details.get("patch-data", {}).get("payloads", []):
            found.add(json.loads(base64.b64decode(payload["data"]))["id"])
    return found


async def _wait_closed(address: str, workflow_id: str, timeout_s: float = 180) -> None:
    """Until the workflow has ended (asking Temporal: a heartbeat probe would keep the session alive)."""
    from temporalio.client import Client, WorkflowExecutionStatus

    client = await Client.connect(address)
    deadline = time.monotonic() + timeout_s
    while (await client.get_workflow_handle(workflow_id).describe()).status == WorkflowExecutionStatus.RUNNING:
        assert time.monotonic() < deadline, f"{workflow_id} never ended"
        await asyncio.sleep(1)


async def dump(address: str, out: Path, tag: str = "") -> list[str]:
    from temporalio.client import Client

    client = await Client.connect(address)
    written, counts = [], {}
    async for wf in client.list_workflows():
        history = await client.get_workflow_handle(wf.id, run_id=wf.run_id).fetch_history()
        counts[wf.workflow_type] = counts.get(wf.workflow_type, 0) + 1
        name = f"{wf.workflow_type}-{tag + '-' if tag else ''}{counts[wf.workflow_type]}.json"
        (out / name).write_text(json.dumps({"workflow_id": wf.id, "history": json.loads(history.to_json())}))
        written.append(name)
    return written


def main() -> None:
    import argparse

    from tinkerflow.cli.launch import launch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--add",
        metavar="TAG",
        default="",
        help="keep the recorded histories and add these as <WorkflowType>-TAG-<n>.json (record the "
        "payload shapes of a new release beside the old ones)",
    )
    parser.add_argument(
        "--paging",
        action="store_true",
        help="record the paging scenario (more runs than adapter slots) instead of the usual one; with --add",
    )
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="record the pipelined-dispatch scenario (several runs stepping at once, a worker killed with steps in "
        "flight) instead of the usual one; with --add",
    )
    parser.add_argument(
        "--sampler-restart",
        action="store_true",
        help="record the sampler-restart scenario (three kinds of sampling client with samples in flight when the "
        "JAX worker is killed) instead of the usual one; with --add",
    )
    args = parser.parse_args()
    scenarios = [name for name in ("paging", "pipeline", "sampler_restart") if getattr(args, name)]
    if scenarios and not args.add:
        parser.error("--paging, --pipeline and --sampler-restart add to the recorded histories: give them --add TAG")
    if len(scenarios) > 1:
        parser.error("record one scenario at a time: --paging, --pipeline or --sampler-restart")
    drive_scenario = {"paging": drive_paging, "pipeline": drive_pipeline, "sampler_restart": drive_sampler_restart}

    state = Path(tempfile.mkdtemp(prefix="tinkerflow-record-")) / "state"
    extra = ["--session-timeout-s", "20", "--auto-snapshot-every", "2", "--restart-backoff-s", "0.5"]
    if args.paging:
        extra += ["--max-lora-adapters", "2", "--max-live-runs-per-tenant", "5"]
    stack = launch(state, api_key=API_KEY, extra=extra)
    try:
        (drive_scenario[scenarios[0]] if scenarios else drive)(stack)
        time.sleep(2)  # let the last workflow tasks land in history
        if not args.add:
            shutil.rmtree(OUT, ignore_errors=True)
        OUT.mkdir(parents=True, exist_ok=True)
        written = asyncio.run(dump(stack.temporal_address, OUT, args.add))
        for name in written:
            print(name, (OUT / name).stat().st_size, "bytes")
        if args.pipeline:  # the scenario is only worth keeping if a batch was queued behind another
            marked = set().union(*(patches_marked(OUT / n) for n in written if n.startswith("Coordinator-")))
            if "coordinator-pipelined-dispatch-v1" not in marked:
                raise SystemExit(f"no batch was pipelined in this recording (markers: {sorted(marked)}); record again")
        if args.sampler_restart:  # only worth keeping if a call was lost and sent again
            marked = set().union(*(patches_marked(OUT / n) for n in written if n.startswith("SampleRequest-")))
            if "sample-rerun-lost-v1" not in marked:
                raise SystemExit(f"no sample call was lost in this recording (markers: {sorted(marked)}); record again")
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
