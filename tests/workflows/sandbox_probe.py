"""A workflow that reports which class object `Outcome` is inside its sandbox (tests/workflows/test_shared_modules.py).
Its own module, so the sandbox imports nothing of pytest's."""

from __future__ import annotations

from temporalio import workflow

from tinkerflow.workflows.protocol.messages import Outcome


@workflow.defn(name="SandboxProbe")
class SandboxProbe:
    @workflow.run
    async def run(self) -> int:
        return id(Outcome)
