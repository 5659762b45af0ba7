"""checkov over infra/: every finding is either fixed or accepted, with its reason, in infra/checkov-baseline.yaml."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.infra.conftest import INFRA, REPO

FRAMEWORKS = ["terraform", "kubernetes", "dockerfile", "secrets"]


def checkov_binary() -> str | None:
    """checkov pins old versions of common packages (packaging, networkx), so it may live in its own venv: honour
    $CHECKOV, then this interpreter's bin/, then PATH."""
    for candidate in (os.environ.get("CHECKOV"), str(Path(sys.executable).parent / "checkov"), shutil.which("checkov")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def _key(path: str) -> str:
    """checkov reports paths relative to the scanned dir, sometimes with the dir in front: normalise to infra/."""
    path = path.lstrip("/")
    return path[len("infra/") :] if path.startswith("infra/") else path


def load_baseline() -> list[dict]:
    accepted = yaml.safe_load((INFRA / "checkov-baseline.yaml").read_text())["accepted"]
    for entry in accepted:
        assert {"check", "file", "resource", "reason"} <= set(entry), entry
        assert len(entry["reason"].strip()) > 20, f"give a real reason for {entry['check']}"
    return accepted


def test_baseline_is_well_formed():
    load_baseline()


@pytest.mark.skipif(
    checkov_binary() is None,
    reason="checkov is not installed (pip install checkov==3.3.30, ideally in its own venv; point $CHECKOV at it)",
)
def test_checkov_has_no_unaccepted_findings():
    proc = subprocess.run(  # pyright: ignore[reportCallIssue] (skipped when checkov is absent)
        [
            checkov_binary(),  # pyright: ignore[reportArgumentType] (skipped when checkov is absent)
            "-d",
            str(INFRA),
            "--quiet",
            "--compact",
            "--skip-download",
            "--framework",
            *FRAMEWORKS,
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_NO_OUTPUT_COLOR": "1"},
    )
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [
        (f["check_id"], _key(f["file_path"]), f["resource"]) for r in reports for f in r["results"]["failed_checks"]
    ]
    parse_errors = [e for r in reports for e in r["results"].get("parsing_errors", [])]
    assert not parse_errors, parse_errors

    baseline = load_baseline()

    def accepted(check: str, file: str, resource: str) -> bool:
        return any(b["check"] == check and b["file"] == file and b["resource"] in ("*", resource) for b in baseline)

    unaccepted = [f for f in failed if not accepted(*f)]
    assert not unaccepted, (
        "new checkov findings (fix them or add them with a reason to infra/checkov-baseline.yaml):"
        + "".join(f"\n  {c} {r} ({p})" for c, p, r in unaccepted)
    )

    stale = [
        b
        for b in baseline
        if not any(b["check"] == c and b["file"] == p and b["resource"] in ("*", r) for c, p, r in failed)
    ]
    assert not stale, "baseline entries that no longer fail (remove them): " + ", ".join(
        f"{b['check']} {b['file']}" for b in stale
    )
