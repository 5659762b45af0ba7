"""A workflow that reports which class objects the protocol's `Outcome` and `OpUsage` are inside its sandbox
(tests/workflows/test_shared_modules.py). Its own module, so the sandbox imports nothing of pytest's."""

from __future__ import annotations

from temporalio import workflow

from tinkerflow.workflows.protocol.messages import Outcome
from tinkerflow.workflows.protocol.usage import OpUsage


@workflow.defn(name="SandboxProbe")
class SandboxProbe:
    @workflow.run
    async def run(self) -> list[int]:
        return [id(Outcome), id(OpUsage)]
