# pyright: reportOptionalMemberAccess=false
# (this test reads Optional results where a None fails the test at once, as an assert would)
"""The Dockerfile, its ignore file and the probe script: static checks (no docker engine here) and probe behaviour."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from tests.infra.conftest import INFRA, REPO

DOCKERFILE = INFRA / "docker" / "Dockerfile"
PROBE = INFRA / "docker" / "probe.py"


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_jax_version_matches_pyproject():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = next(re.search(r"==([\w.]+)", d).group(1) for d in deps if d.startswith("jax["))
    args = dict(rest.split("=", 1) for word, rest in _instructions() if word == "ARG" and "=" in rest)
    assert args["JAX_VERSION"] == pinned


def test_variants_and_runtime_shape():
    text = DOCKERFILE.read_text()
    for needle in (
        'cuda) extra="jax[cuda12]==${JAX_VERSION}"',
        'tpu)  extra="jax[tpu]==${JAX_VERSION}"',
        'pip install "${spec}"',
        "ARG EXTRAS=",
        "ARG BASE_IMAGE=python:3.11-slim",
    ):
        assert needle in text, needle
    assert "nvidia/cuda:" in text  # the documented CUDA base
    ins = _instructions()
    final = ins[max(i for i, (w, r) in enumerate(ins) if w == "FROM") :]
    users = [r for w, r in final if w == "USER"]
    assert users and not users[-1].startswith(("0", "root")), "the final stage must run as a non-root user"
    assert ("ENTRYPOINT", '["tinkerflow"]') in final
    assert ("CMD", '["api"]') in final
    assert any(w == "HEALTHCHECK" for w, _ in final)
    # Every path COPY'd from the build context is let through the ignore file.
    ignore = (INFRA / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for word, rest in ins:
        if word == "COPY" and not rest.startswith("--from"):
            for src in rest.split()[:-1]:
                assert src.rstrip("/") in allowed, f"{src} is COPY'd but excluded by Dockerfile.dockerignore"
                assert (REPO / src).exists(), src


def test_dockerignore_starts_from_nothing():
    lines = [
        line
        for line in (INFRA / "docker" / "Dockerfile.dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines[0] == "*", "exclude everything, then allow what the build needs (.venv, .git, state stay out)"


@pytest.mark.skipif(not shutil.which("hadolint"), reason="no hadolint binary")
def test_hadolint():
    proc = subprocess.run(["hadolint", "--failure-threshold", "error", str(DOCKERFILE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def _probe(*args: str, env: dict | None = None) -> int:
    return subprocess.run(
        [sys.executable, str(PROBE), *args], capture_output=True, timeout=30, env={**os.environ, **(env or {})}
    ).returncode


def test_probe_ready_file(tmp_path: Path):
    ready = tmp_path / "ready"
    assert _probe("ready", str(ready)) == 1
    ready.touch()
    assert _probe("ready", str(ready)) == 0
    assert _probe("ready") == 2  # PATH is required


def test_probe_rejects_a_ready_file_older_than_the_process(tmp_path: Path):
    sys.path.insert(0, str(PROBE.parent))
    try:
        import probe  # pyright: ignore[reportMissingImports] (put on sys.path at run time)
    finally:
        sys.path.pop(0)
    started = probe._pid1_start_epoch()
    if started is None:
        pytest.skip("/proc cannot tell when PID 1 started")
    stale = tmp_path / "stale"
    stale.touch()
    os.utime(stale, (started - 60, started - 60))
    assert probe.check_ready(str(stale)) is False
    fresh = tmp_path / "fresh"
    fresh.touch()
    assert probe.check_ready(str(fresh)) is True
    assert time.time() >= started


def test_probe_temporal_tcp_and_http(tmp_path: Path):
    import http.server
    import socketserver
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/api/v1/healthz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    with socketserver.TCPServer(("127.0.0.1", 0), Handler) as server:
        port = server.server_address[1]
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            assert _probe("temporal", env={"TINKERFLOW_TEMPORAL_ADDRESS": f"127.0.0.1:{port}"}) == 0
            assert _probe("http", f"http://127.0.0.1:{port}/api/v1/healthz") == 0
            assert _probe("http", f"http://127.0.0.1:{port}/nope") == 1
            ready = tmp_path / "r"
            ready.touch()
            assert (
                _probe("ready", str(ready), "temporal", env={"TINKERFLOW_TEMPORAL_ADDRESS": f"127.0.0.1:{port}"}) == 0
            )
        finally:
            server.shutdown()
    # Nothing listens there any more.
    assert _probe("temporal", env={"TINKERFLOW_TEMPORAL_ADDRESS": f"127.0.0.1:{port}"}) == 1
