"""What every JSON line of the device check carries, so a line read alone says where it was measured: the device,
its driver, the jax/flax versions, the git commit and a UTC timestamp (measure.emit adds them)."""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


@functools.cache
def static() -> dict:
    """Looked up once per process: versions from the installed metadata (no jax import), the commit (a device
    machine's copy may have no .git: TINKERFLOW_COMMIT then, else None) and the NVIDIA driver, if any."""
    commit = _run(["git", "rev-parse", "HEAD"]) or os.environ.get("TINKERFLOW_COMMIT")
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {"jax": _version("jax"), "flax": _version("flax"), "commit": commit, "driver": driver}


_device: list[str] = []


def device() -> str | None:
    """The first device's kind, once jax is imported in this process: the check's parent never imports it (it
    would take the accelerator's memory from its workers), so its own lines name the GPU from nvidia-smi."""
    if not _device and "jax" in sys.modules:
        _device.append(sys.modules["jax"].devices()[0].device_kind)
    if _device:
        return _device[0]
    return _gpu_name()


@functools.cache
def _gpu_name() -> str | None:
    return _run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])


def stamp() -> dict:
    return {
        "device": device(),
        **static(),
        "utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
