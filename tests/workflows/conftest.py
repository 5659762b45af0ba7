"""Fixtures for the workflow unit tests (the harness itself lives in wf_harness.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from temporalio.testing import WorkflowEnvironment
from wf_harness import Tinker, local_temporal, tinker_world


@pytest_asyncio.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    async with local_temporal() as env:
        yield env  # each test's tinker_world brings its own workflow worker, on its own task queue


@pytest_asyncio.fixture
async def tinker(temporal_env: WorkflowEnvironment) -> AsyncIterator[Tinker]:
    async with tinker_world(temporal_env.client) as world:
        yield world


@pytest.fixture
def tinker_factory(temporal_env: WorkflowEnvironment):
    """For tests that need a world with other settings (e.g. max_adapters=2)."""
    return lambda **kwargs: tinker_world(temporal_env.client, **kwargs)
