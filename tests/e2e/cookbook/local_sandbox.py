"""A sandbox for harbor_rl's tasks without a cloud: tinker_cookbook's SandboxInterface over a local directory.

harbor_rl takes its sandbox as a parameter (`cli_main(..., sandbox_factory=...)`; the default builds Modal cloud
containers from the task's Dockerfile). This one runs each command with bash in its own directory and maps the
container's absolute paths the Harbor grader uses (/tests, /logs, /root, /app) into it, so a task written for a
container (tests/test.sh writing /logs/verifier/reward.txt) grades the same way here. It isolates nothing: use it
only for tasks you wrote yourself."""

from __future__ import annotations

import asyncio
import re
import shutil
import tempfile
from pathlib import Path

from tinker_cookbook.sandbox.sandbox_interface import SandboxResult

_MAPPED = ("/tests", "/logs", "/root", "/app")
_PATH = re.compile(r"(?<![\w./])(" + "|".join(re.escape(p) for p in _MAPPED) + r")(?=/|\b)")


class LocalDirectorySandbox:
    def __init__(self, root: Path):
        self.root = root
        for p in _MAPPED:
            (root / p.lstrip("/")).mkdir(parents=True, exist_ok=True)

    @property
    def sandbox_id(self) -> str:
        return f"local:{self.root}"

    def _map(self, text: str) -> str:
        return _PATH.sub(lambda m: str(self.root) + m.group(1), text)

    async def send_heartbeat(self, timeout: int = 30) -> None:
        return None

    async def run_command(
        self, command: str, workdir: str | None = None, timeout: int = 60, max_output_bytes: int | None = None
    ) -> SandboxResult:
        cwd = self._map(workdir) if workdir else str(self.root / "root")
        proc = await asyncio.create_subprocess_exec(
            "bash",
            "-c",
            self._map(command),
            cwd=cwd,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except TimeoutError:
            proc.kill()
            return SandboxResult(stdout="", stderr="timed out", exit_code=124)
        cap = max_output_bytes or 128 * 1024
        return SandboxResult(
            stdout=out[:cap].decode(errors="replace"),
            stderr=err[:cap].decode(errors="replace"),
            exit_code=proc.returncode or 0,
        )

    async def read_file(self, path: str, max_bytes: int | None = None, timeout: int = 60) -> SandboxResult:
        target = Path(self._map(path))
        if not target.is_file():
            return SandboxResult(stdout="", stderr=f"{path}: no such file", exit_code=1)
        data = target.read_bytes()[: max_bytes or None]
        return SandboxResult(stdout=data.decode(errors="replace"), stderr="", exit_code=0)

    async def write_file(
        self, path: str, content: str | bytes, executable: bool = False, timeout: int = 60
    ) -> SandboxResult:
        target = Path(self._map(path))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content.encode() if isinstance(content, str) else content)
        if executable:
            target.chmod(0o755)
        return SandboxResult(stdout="", stderr="", exit_code=0)

    async def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


async def local_sandbox_factory(env_dir: Path, timeout: int) -> LocalDirectorySandbox:
    return LocalDirectorySandbox(Path(tempfile.mkdtemp(prefix="harbor-sandbox-")))
