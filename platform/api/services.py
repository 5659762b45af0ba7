"""What the routes need, built once per process: the Temporal client, the store, the served-model registry.

Caches here are only caches of immutable or slowly-changing facts (which models are served, what a sampler id
points at); losing them costs a lookup, never an answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field

from temporalio.client import Client

from tinkerflow.common.settings import Settings
from tinkerflow.common.store import ClaimCheckStore
from tinkerflow.workflows.messages import ModelCard, SamplerInfo

log = logging.getLogger(__name__)
REGISTRY_TTL_S = 2.0


class ModelRegistry:
    """Served base models = running Coordinator workflows; each carries its model card in its memo."""

    def __init__(self, client: Client):
        self._client = client
        self._cards: dict[str, ModelCard] = {}
        self._fetched_at = 0.0
        self._lock = asyncio.Lock()

    async def cards(self, fresh: bool = False) -> dict[str, ModelCard]:
        async with self._lock:
            if fresh or time.monotonic() - self._fetched_at > REGISTRY_TTL_S:
                cards: dict[str, ModelCard] = {}
                query = "WorkflowType = 'Coordinator' AND ExecutionStatus = 'Running'"
                async for wf in self._client.list_workflows(query):
                    memo = await wf.memo()
                    if "model" in memo:
                        card = ModelCard(**memo["model"])
                        cards.setdefault(card.name, card)
                self._cards, self._fetched_at = cards, time.monotonic()
            return self._cards

    async def get(self, name: str) -> ModelCard | None:
        card = (await self.cards()).get(name)
        if card is None:  # a worker may have registered a moment ago
            card = (await self.cards(fresh=True)).get(name)
        return card


@dataclass
class Services:
    settings: Settings
    client: Client
    store: ClaimCheckStore
    registry: ModelRegistry
    samplers: dict[str, SamplerInfo] = field(default_factory=dict)  # immutable once created: safe to cache

    def owner_of(self, api_key: str | None) -> str:
        if not self.settings.api_keys or not api_key:
            return ""
        return hashlib.sha256(api_key.encode()).hexdigest()[:16]
