"""Container probes for tinkerflow processes (stdlib only; used by Kubernetes exec probes and Docker HEALTHCHECK).

The workers have no HTTP port yet (a Prometheus /metrics endpoint is planned; when it lands, probes should move to
httpGet on it). Until then a worker is judged by two facts it can show without a port:

    probe.py ready PATH      the worker touched PATH (its --ready-file), which it does once it is connected to
                             Temporal and polling its task queue; exit 0 when PATH exists and is newer than the
                             container's main process (a file left by an earlier start does not count)
    probe.py temporal        TCP connect to TINKERFLOW_TEMPORAL_ADDRESS (host:port) within 2 s
    probe.py http URL        GET URL answers 2xx within 2 s (the API's /api/v1/healthz)
    probe.py auto            what Docker's HEALTHCHECK runs: `http` for `tinkerflow api`, `ready` for the workers

Several checks may be chained: `probe.py ready /tmp/tinkerflow-ready temporal` passes only if both pass.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.request

DEFAULT_READY_FILE = "/tmp/tinkerflow-ready"


def _pid1_start_epoch() -> float | None:
    """When the container's main process started (None where /proc cannot tell)."""
    try:
        with open("/proc/1/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def check_ready(path: str) -> bool:
    """PATH exists and was touched by the running process, not left over from a previous container start (the
    volume under /tmp outlives a container restart inside the same pod)."""
    try:
        touched = os.stat(path).st_mtime
    except OSError:
        return False
    started = _pid1_start_epoch()
    return started is None or touched >= started - 2.0


def check_temporal(address: str | None = None, timeout: float = 2.0) -> bool:
    address = address or os.environ.get("TINKERFLOW_TEMPORAL_ADDRESS", "127.0.0.1:7233")
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def check_http(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (a fixed local URL)
            return 200 <= response.status < 300
    except OSError:
        return False


def _pid1_command() -> list[str]:
    try:
        with open("/proc/1/cmdline", "rb") as f:
            return [part.decode(errors="replace") for part in f.read().split(b"\0") if part]
    except OSError:
        return []


def check_auto() -> bool:
    argv = _pid1_command()
    if "api" in argv:
        return check_http(f"http://127.0.0.1:{os.environ.get('TINKERFLOW_PORT', '8000')}/api/v1/healthz")
    ready = argv[argv.index("--ready-file") + 1] if "--ready-file" in argv[:-1] else DEFAULT_READY_FILE
    return check_ready(ready)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    i = 0
    while i < len(argv):
        name = argv[i]
        if name == "ready":
            if i + 1 >= len(argv):
                print("ready needs a PATH", file=sys.stderr)
                return 2
            ok, i = check_ready(argv[i + 1]), i + 2
        elif name == "temporal":
            ok, i = check_temporal(), i + 1
        elif name == "http":
            ok, i = check_http(argv[i + 1]), i + 2
        elif name == "auto":
            ok, i = check_auto(), i + 1
        else:
            print(f"unknown check {name!r}", file=sys.stderr)
            return 2
        if not ok:
            print(f"probe {name} failed", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
