"""Shared test set-up: offline Hugging Face, and where the acceptance scripts live."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

REPO = Path(__file__).resolve().parents[1]
ACCEPTANCE = REPO.parent / "shared" / "acceptance"
