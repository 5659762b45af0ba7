"""What the soak (tests/e2e/test_soak.py) reads of the running stack: each part's RSS, the JAX worker's compiles, the
coordinator's state and the workflows still running."""

from __future__ import annotations

import asyncio
import time

import psutil
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from tinkerflow.cli.launch import RunningStack


def stack_processes(stack: RunningStack) -> dict[str, psutil.Process]:
    """The parts `tinkerflow up` started, by name (their command line says which)."""
    parts = {}
    for p in psutil.Process(stack.proc.pid).children():
        cmd = p.cmdline()
        if "tinkerflow.cli.main" in cmd:
            parts[cmd[cmd.index("tinkerflow.cli.main") + 1]] = p
        elif any("temporal" in a for a in cmd[:1]):
            parts["temporal"] = p
    return parts


def rss_mb(parts: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, p in parts.items():
        total = 0
        for q in [p, *p.children(recursive=True)]:
            try:
                total += q.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        out[name] = round(total / 2**20, 1)
    return out


def compiles_logged(jax_log) -> int:
    """jit compiles the JAX worker has logged so far (one INFO line each)."""
    return jax_log.read_text(errors="replace").count("aot_cache: compiled")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def describe_coordinator(client: Client, model: str, timeout_s: float = 60) -> dict:
    """The coordinator's `describe`. Temporal buffers one query while a workflow task runs and refuses more
    (RESOURCE_EXHAUSTED, "consistent query buffer is full"); the API queries it too, and under load one of its tasks
    can run for seconds (a continue-as-new rejected for signals that came meanwhile replays the whole history), so
    retry that for a while."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await client.get_workflow_handle(f"coordinator/{model}/default").query("describe")
        except RPCError as e:
            if e.status != RPCStatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            await asyncio.sleep(1)


async def snapshots_held(stack: RunningStack, model: str) -> int:
    return (await describe_coordinator(await Client.connect(stack.temporal_address), model))["snapshots"]


async def settled_coordinator(client: Client, model: str, timeout_s: float = 60) -> dict:
    """The coordinator once nothing is pending and no worker is busy (or its last state when the time is up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        d = await describe_coordinator(client, model)
        if (d["pending"] == 0 and not any(w["busy"] for w in d["workers"].values())) or time.monotonic() > deadline:
            return d
        await asyncio.sleep(0.5)


async def running_workflows(client: Client, workflow_type: str) -> list:
    """Running workflows of a type; each confirmed by a describe (the visibility list may lag a just-closed one)."""
    query = f"WorkflowType = '{workflow_type}' AND ExecutionStatus = 'Running'"
    listed = [wf async for wf in client.list_workflows(query)]
    return [
        wf
        for wf in listed
        if (await client.get_workflow_handle(wf.id).describe()).status == WorkflowExecutionStatus.RUNNING
    ]
