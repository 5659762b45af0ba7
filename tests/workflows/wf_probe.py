"""Runs one coordinator scenario in a process of its own and prints one JSON line with what happened.

The scenarios here drive the Coordinator into a loop that never yields (see test_workflows_bugs.py). The SDK's
deadlock detector fails the workflow task but cannot reliably stop the spinning workflow thread, and a worker with
such a thread never shuts down; so these run in a child process that exits with os._exit after stopping its own dev
server, and the parent kills the whole process group if even that hangs.

    python wf_probe.py two_workers | continue_as_new_while_busy
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback

from mock_engine import MockEngine, blob, new_queue
from temporalio import activity
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker
from wf_harness import ALL_WORKFLOWS, TEMPORAL_BINARY, Tinker, body_hash, server_args, unique_queue

from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.messages import Batch, BatchResult, SamplerInfo, SampleStart
from tinkerflow.workflows.sample_request import SampleRequestWorkflow

WAIT = 5.0  # a healthy coordinator answers in well under a second
SUGGEST_CONTINUE_AS_NEW_AT = 60


def activity_worker(client, engine: MockEngine, queue: str) -> Worker:
    @activity.defn(name="run_batch")
    async def run_batch(batch: Batch) -> BatchResult:
        return await engine.run_batch(batch)

    return Worker(client, task_queue=queue, activities=[run_batch], max_concurrent_activities=1)


async def answered(awaitable, timeout: float = WAIT) -> bool:
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        return False
    return task.exception() is None and getattr(task.result(), "ok", True)


async def two_workers(tinker: Tinker, spawn) -> dict:
    second = new_queue()
    spawn(second)
    await tinker.register(second)
    sid, _ = await tinker.start_session()
    runs = [await tinker.ready_run(sid, n) for n in (1, 2, 3)]
    placements = (await tinker.describe_coordinator())["placements"]
    (first_id, first_run), *others = runs
    same_worker = next(run for model_id, run in others if placements[model_id][0] == placements[first_id][0])

    busy = await tinker.submit(first_run, tinker.fwd(1, hold=True))
    await tinker.engine.wait_for(lambda: len(tinker.engine.of_kind("forward_backward")) == 1)
    queued = await tinker.submit(same_worker, tinker.fwd(1))  # waits for the busy worker; the other one is idle
    await asyncio.sleep(1.0)
    tinker.engine.release.set()
    query, busy_ok, queued_ok = await asyncio.gather(
        answered(tinker.describe_coordinator()), answered(busy.result()), answered(queued.result())
    )
    return {"query_answered": query, "busy_op_answered": busy_ok, "queued_op_answered": queued_ok}


async def continue_as_new_while_busy(tinker: Tinker, spawn) -> dict:
    sid, _ = await tinker.start_session()
    _, run = await tinker.ready_run(sid, 1)
    busy = await tinker.submit(run, tinker.fwd(1, hold=True))
    await tinker.engine.wait_for(lambda: len(tinker.engine.of_kind("forward_backward")) == 1)
    # An RL client's burst of sample calls arrives while the engine is busy (~4 coordinator history events each),
    # until the coordinator's history is well past the limit at which the server suggests continue-as-new.
    sampler = SamplerInfo(sampler_id=names.sampler_id_for(sid, 1), base_model=tinker.base_model)
    samples = []
    history = 0
    while history < SUGGEST_CONTINUE_AS_NEW_AT + 20 and len(samples) < 200:
        for _ in range(5):
            n = len(samples)
            samples.append(
                await tinker.client.start_workflow(
                    SampleRequestWorkflow.run,
                    SampleStart(sampler=sampler, payloads=[blob(f"mem://s/{n}")]),
                    id=names.sample_workflow_id(sampler.sampler_id, body_hash("s", n)),
                    task_queue=tinker.workflow_queue,
                )
            )
        await asyncio.sleep(0.2)
        history = (await tinker.coordinator.describe()).history_length
    await asyncio.sleep(1.0)
    tinker.engine.release.set()
    busy_ok, samples_ok = await asyncio.gather(
        answered(busy.result()), answered(asyncio.gather(*(h.result() for h in samples)))
    )
    return {
        "history_length_while_busy": history,
        "samples": len(samples),
        "busy_op_answered": busy_ok,
        "samples_answered": samples_ok,
    }


SCENARIOS = {
    "two_workers": (two_workers, ()),
    "continue_as_new_while_busy": (
        continue_as_new_while_busy,
        (f"limit.historyCount.suggestContinueAsNew={SUGGEST_CONTINUE_AS_NEW_AT}",),
    ),
}


async def main(name: str) -> dict:
    scenario, dynamic_config = SCENARIOS[name]
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(TEMPORAL_BINARY), dev_server_extra_args=server_args(*dynamic_config)
    )
    tasks = []
    try:
        client = env.client
        queue = unique_queue("probe")
        tasks.append(asyncio.create_task(Worker(client, task_queue=queue, workflows=ALL_WORKFLOWS).run()))
        engine = MockEngine()
        tinker = Tinker(client=client, engine=engine, base_model=f"probe-{name}", workflow_queue=queue)

        def spawn(queue: str) -> None:
            tasks.append(asyncio.create_task(activity_worker(client, engine, queue).run()))
            tinker.queues.append(queue)

        first = new_queue()
        spawn(first)
        await tinker.register(first)
        return await asyncio.wait_for(scenario(tinker, spawn), 40)
    finally:
        # Workers are left running on purpose: shutting one down waits for its spinning workflow thread.
        await asyncio.wait_for(env.shutdown(), 10)


if __name__ == "__main__":
    code = 0
    try:
        result = asyncio.new_event_loop().run_until_complete(main(sys.argv[1]))
        print("RESULT " + json.dumps(result), flush=True)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skips joining the workflow worker's threads, one of which may never return
