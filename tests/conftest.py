"""Shared test set-up: offline Hugging Face, and where the acceptance scripts live."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

REPO = Path(__file__).resolve().parents[1]
ACCEPTANCE = REPO.parent / "shared" / "acceptance"


def pytest_unconfigure(config) -> None:
    # SDK clients made by tests keep heartbeating from background threads until the interpreter exits; once their
    # stacks are stopped that only produces connection warnings after pytest's summary. Silence them then.
    import logging

    logging.getLogger("tinker.lib.internal_client_holder").setLevel(logging.CRITICAL)
