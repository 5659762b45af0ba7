"""What the routes need, built once per process: the Temporal client, the store, the served-model registry.

Caches here are only caches of immutable or slowly-changing facts (which models are served, what a sampler id
points at); losing them costs a lookup, never an answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from temporalio.client import Client

from tinkerflow.api.batch_results import BatchResults
from tinkerflow.api.queue_depths import QueueDepths
from tinkerflow.api.quota_checks import Quotas
from tinkerflow.common.audit import AuditLog
from tinkerflow.common.checkpoints import CheckpointStore
from tinkerflow.common.settings import Settings
from tinkerflow.common.store import ClaimCheckStore
from tinkerflow.common.tenancy import key_id
from tinkerflow.workflows.protocol.messages import ModelCard, SamplerInfo

if TYPE_CHECKING:
    from tinkerflow.api.sample_batches import SampleBatcher
    from tinkerflow.api.worker_metrics import WorkerMetrics

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
    checkpoints: CheckpointStore
    signing_key: bytes = b""  # signs download URLs (external_weights_urls)
    api_keys: tuple[str, ...] = ()  # resolved once at start: flags, env and the keys file
    sample_batcher: SampleBatcher | None = None
    worker_metrics: WorkerMetrics | None = None  # the console's tokens/s (None: no worker /metrics to read)
    samplers: dict[str, SamplerInfo] = field(default_factory=dict)  # immutable once created: safe to cache
    quotas: Quotas = field(default_factory=Quotas)  # --quota-file's, and the tally they are checked against
    queue_depths: QueueDepths = field(init=False)  # one Coordinator queue-depth query at a time
    batch_results: BatchResults = field(init=False)  # one shared result wait per sample batch workflow
    audit_log: AuditLog = field(init=False)  # in the claim-check store (common/audit.py)

    def __post_init__(self) -> None:
        self.queue_depths = QueueDepths(self.client)
        self.batch_results = BatchResults(self.client)
        self.audit_log = AuditLog(self.store)

    async def audit(self, event: str, who: str, obj: str, **details: object) -> None:
        """Record what a key did to `obj` (common/audit.py); after the change, so a refused request records nothing."""
        await asyncio.to_thread(self.audit_log.record, event, who, obj, **details)

    async def queued_samples(self, coordinator_id: str) -> tuple[int, int]:
        """(samples, tokens of work) waiting in a coordinator's queue, from one query shared by concurrent callers."""
        return await self.queue_depths.depth(coordinator_id)

    def owner_of(self, api_key: str | None) -> str:
        if not self.api_keys or not api_key:
            return ""
        return key_id(self.signing_key, api_key)
