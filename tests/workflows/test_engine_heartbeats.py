"""The JAX worker's activity heartbeats reach Temporal as they are made, not throttled to 0.8 x the heartbeat timeout.

A long engine call (a first compile of an MoE sampler runs minutes on a loaded CPU) is kept alive only by the side
thread's heartbeats (activities/engine_activities.py). With the SDK's default throttle, a 15 s heartbeat timeout lets
one heartbeat through every 12 s, and a slow server call then times the batch out. Here the activity's timeout is
600 s, so the default throttle would hold the second heartbeat back for 480 s: the server seeing it within the test's
deadline shows that the worker built by `activity_worker` sends heartbeats at the side thread's pace.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import uuid
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from tinkerflow.activities.heartbeats import heartbeats
from tinkerflow.workers.jax_worker import activity_worker
from tinkerflow.workflows.coordinator.dispatch import PIPELINE_DEPTH

SECOND_PHASE = threading.Event()
DONE = threading.Event()


@activity.defn(name="long_engine_call")
def long_engine_call() -> str:
    with heartbeats(0.2) as progress:  # as run_batch, at a faster pace
        progress[0] = "compiling"
        SECOND_PHASE.wait(120)
        progress[0] = "decoding"
        DONE.wait(120)
    return "done"


@workflow.defn(name="HeartbeatProbe")
class HeartbeatProbe:
    @workflow.run
    async def run(self, queue: str) -> str:
        return await workflow.execute_activity(
            "long_engine_call",
            task_queue=queue,
            start_to_close_timeout=timedelta(minutes=5),
            heartbeat_timeout=timedelta(seconds=600),
        )


async def _recorded(client, handle) -> str | None:
    desc = await handle.describe()
    pending = desc.raw_description.pending_activities
    if not pending or not pending[0].heartbeat_details.payloads:
        return None
    [details] = await client.data_converter.decode(pending[0].heartbeat_details.payloads)
    return details


async def _wait_recorded(client, handle, want: str, deadline_s: float = 120) -> None:
    """Poll the server until the activity's recorded heartbeat says `want` (a hang guard, not a timing)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    seen = None
    while loop.time() < end:
        seen = await _recorded(client, handle)
        if seen == want:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the server still records heartbeat {seen!r}, not {want!r}, after {deadline_s:g} s")


async def test_side_thread_heartbeats_reach_the_server_unthrottled(temporal_env):
    client = temporal_env.client
    queue, wf_queue = f"hb-{uuid.uuid4().hex[:8]}", f"hb-wf-{uuid.uuid4().hex[:8]}"
    SECOND_PHASE.clear()
    DONE.clear()
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=PIPELINE_DEPTH)  # as the JAX worker makes it
    worker = activity_worker(client, queue, long_engine_call, executor)
    probe = Worker(client, task_queue=wf_queue, workflows=[HeartbeatProbe], workflow_runner=UnsandboxedWorkflowRunner())
    try:
        async with worker, probe:
            handle = await client.start_workflow(
                HeartbeatProbe.run, queue, id=f"hb-probe-{uuid.uuid4().hex}", task_queue=wf_queue
            )
            await _wait_recorded(client, handle, "compiling")  # the first heartbeat is never throttled
            SECOND_PHASE.set()
            await _wait_recorded(client, handle, "decoding")  # the default throttle would hold this one 480 s
            DONE.set()
            assert await handle.result() == "done"
    finally:
        SECOND_PHASE.set()
        DONE.set()
        executor.shutdown(wait=False)
