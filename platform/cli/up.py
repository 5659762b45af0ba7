"""`tinkerflow up`: the whole stack on one machine, each part its own process, stopped together.

Parts start in dependency order (Temporal, workflow worker, JAX worker, API); a spinner shows each until it is ready.
Once all are up, `up` supervises them (supervise.py): a part that exits unexpectedly is started again with backoff, and
only Ctrl-C, SIGTERM or a crash loop stops the stack. `<state-dir>/up-parts.json` names each part's pid and log.
Children get the resolved settings through TINKERFLOW_* environment variables, so `up` and the single-part commands
share one code path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from rich.console import Console

from tinkerflow.cli import temporal_server
from tinkerflow.cli.supervise import RESTARTS, CrashLoop, RestartPolicy, describe_exit, die_with_parent
from tinkerflow.common.settings import Settings
from tinkerflow.common.tenancy import tenant_mode

console = Console(stderr=True, soft_wrap=True)  # log paths and restart lines stay whole, never folded
READY_TIMEOUT_S = {"temporal": 60, "workflow-worker": 120, "jax-worker": 900, "api": 120}


@dataclass
class Part:
    name: str
    proc: subprocess.Popen
    log_path: Path
    kind: str = ""  # the command it runs ("jax-worker" for every JAX worker), which sets its ready timeout
    cmd: tuple[str, ...] = ()
    restart_at: float | None = None  # set while the part is down and waiting out its backoff
    restarts: int = 0


def child_env(settings: Settings) -> dict[str, str]:
    """The environment of `up`'s parts: ours, plus every resolved setting as its TINKERFLOW_* variable (so a flag
    given to `up` reaches every part, and a field added to Settings needs no line here)."""
    env = dict(os.environ)
    env.update(settings.as_env())
    env["HF_HUB_OFFLINE"] = env.get("HF_HUB_OFFLINE", "1")
    return env


class Stack:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.parts: list[Part] = []
        self.logs = settings.state_dir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.ready_dir = Path(tempfile.mkdtemp(prefix="tinkerflow-ready-"))

    def start(self, name: str, cmd: list[str], kind: str = "") -> Part:
        log_path = self.logs / f"{name}.log"
        self.settings.state_dir.mkdir(parents=True, exist_ok=True)
        part = Part(name, self._spawn(cmd, log_path), log_path, kind or name, cmd=tuple(cmd))
        RESTARTS.labels(name)  # exported from the start: a part never restarted reads 0, not "no data"
        self.parts.append(part)
        self._write_parts()
        return part

    def _spawn(self, cmd, log_path: Path) -> subprocess.Popen:
        with open(log_path, "ab") as out:  # the child keeps its own descriptor
            # Own session: a Ctrl-C in `up`'s terminal reaches `up` alone, which stops the parts in order. SIGKILL when
            # `up` dies without doing so (killed -9, crashed): a part left running would hold the ports and state dir.
            return subprocess.Popen(
                list(cmd),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=child_env(self.settings),
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )

    def respawn(self, part: Part) -> None:
        """Start a part that exited again, with the same command, log and settings (no wait: others need watching)."""
        part.proc = self._spawn(part.cmd, part.log_path)
        part.restart_at = None
        part.restarts += 1
        self._write_parts()

    def _write_parts(self) -> None:
        """Which pid runs which part now, for a person (and for tests that kill one part of a running `up`)."""
        facts = {p.name: {"pid": p.proc.pid, "log": str(p.log_path), "restarts": p.restarts} for p in self.parts}
        target = self.settings.state_dir / "up-parts.json"
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(facts, indent=1))
        tmp.replace(target)

    def supervise(self, policy: RestartPolicy, until=lambda: None) -> int:
        """Watch every part until `until()` returns an exit status (the `-- CMD` finished) or a part crash-loops.

        A part that exits is restarted after its backoff; while it waits, the others are watched as before. The
        processes of a JAX worker and the workflow worker are stateless towards Temporal, so a restarted one simply
        polls again (runs on a JAX worker restore from their snapshots); the Temporal dev server reopens its file."""
        while True:
            status = until()
            if status is not None:
                return status
            now = time.monotonic()
            for part in self.parts:
                if part.restart_at is None and part.proc.poll() is not None:
                    why = describe_exit(part.proc.returncode)
                    decision = policy.on_exit(part.name, now)
                    if isinstance(decision, CrashLoop):
                        console.print(
                            f"[red]{_clock()} {part.name} is crash-looping: it exited "
                            f"{decision.restarts} times within {decision.window_s:.0f} s (last: {why}); "
                            f"stopping everything. Its log: {part.log_path}"
                        )
                        return 1
                    part.restart_at = now + decision.delay_s
                    console.print(
                        f"[yellow]{_clock()} {part.name} exited unexpectedly ({why}); restarting in "
                        f"{decision.delay_s:.1f} s (restart {decision.recent} of at most "
                        f"{policy.max_restarts} within {policy.window_s:.0f} s). Its log: {part.log_path}"
                    )
                elif part.restart_at is not None and now >= part.restart_at:
                    self.respawn(part)
                    RESTARTS.labels(part.name).inc()
                    console.print(
                        f"{_clock()} {part.name} restarted (pid {part.proc.pid}; {part.restarts} restart(s) so far)"
                    )
            time.sleep(0.2)

    def start_tinkerflow(self, command: str, *extra: str, name: str | None = None) -> Part:
        name = name or command
        ready = self.ready_dir / name
        return self.start(
            name,
            [sys.executable, "-m", "tinkerflow.cli.main", command, "--ready-file", str(ready), *extra],
            kind=command,
        )

    def wait_ready(self, part: Part, check) -> None:
        t0 = time.monotonic()
        with console.status(f"starting {part.name} …"):
            while not check():
                if part.proc.poll() is not None:
                    tail = part.log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(
                        f"{part.name} exited with {part.proc.returncode}; its log ({part.log_path}) ends with:\n{tail}"
                    )
                if time.monotonic() - t0 > READY_TIMEOUT_S[part.kind]:
                    raise RuntimeError(
                        f"{part.name} not ready after {READY_TIMEOUT_S[part.kind]} s; see {part.log_path}"
                    )
                time.sleep(0.1)
        console.print(f"[green]✓[/green] {part.name} ready ({time.monotonic() - t0:.1f} s) · log {part.log_path}")

    # --- the parts, each started in its own process and awaited until ready -------------------------------------

    def start_temporal(self, port: int, ui_port: int, headless: bool) -> Part:
        address = f"127.0.0.1:{port}"
        if _port_open(address):
            raise RuntimeError(
                f"port {port} is busy: another Temporal (or `tinkerflow up`) is running; stop it, "
                "pick --temporal-port, or pass --temporal-address to use it"
            )
        part = self.start(
            "temporal",
            temporal_server.command(
                self.settings.state_dir / "temporal.db",
                port=port,
                ui_port=ui_port,
                namespace=self.settings.temporal_namespace,
                headless=headless,
            ),
        )
        self.wait_ready(part, lambda: listens(part.proc.pid, port))
        return part

    def start_worker(self, command: str, *extra: str, name: str | None = None) -> Part:
        """`workflow-worker` or `jax-worker` (`name` tells two of a kind apart): ready when it touches its ready
        file."""
        name = name or command
        (self.ready_dir / name).unlink(missing_ok=True)
        part = self.start_tinkerflow(command, *extra, name=name)
        self.wait_ready(part, lambda: (self.ready_dir / name).exists())
        return part

    def start_api(self) -> Part:
        part = self.start_tinkerflow("api")
        self.wait_ready(part, lambda: _api_ready(self.base_url, self.api_key))
        return part

    def served_model(self) -> str:
        return served_models(self.base_url, self.api_key)[0]

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.port}"

    @property
    def api_key(self) -> str:
        keys = self.settings.accepted_api_keys()
        return keys[0] if keys else "tml-local"

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill one part (its whole process group) and forget it: for fault-injection tests."""
        for part in [p for p in self.parts if p.name == name]:
            os.killpg(part.proc.pid, sig)
            part.proc.wait()
            self.parts.remove(part)

    def stop(self) -> None:
        for part in reversed(self.parts):
            if part.proc.poll() is None:
                os.killpg(part.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for part in reversed(self.parts):
            try:
                part.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(part.proc.pid, signal.SIGKILL)
                part.proc.wait()


def _clock() -> str:
    return time.strftime("%H:%M:%S")


def _port_open(address: str) -> bool:
    import socket

    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def listens(pid: int, port: int) -> bool:
    """Whether process `pid` itself listens on TCP `port`. A part's readiness, rather than an open port: a port
    another process took between the choice and the bind must not pass for the part (which then fails to bind and
    exits, and `wait_ready` shows its log)."""
    try:
        return any(
            c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
            for c in psutil.Process(pid).net_connections("tcp")
        )
    except psutil.Error:  # gone, or not ours to read
        return False


def served_models(base_url: str, api_key: str) -> list[str]:
    """The base models the API serves right now ([] while it is not up or sees no JAX worker yet)."""
    try:
        caps = httpx.get(f"{base_url}/api/v1/get_server_capabilities", timeout=2, headers={"X-API-Key": api_key})
    except httpx.HTTPError:
        return []
    return [m["model_name"] for m in caps.json().get("supported_models", [])] if caps.status_code == 200 else []


def _api_ready(base_url: str, api_key: str) -> bool:
    """Ready = the API answers and already sees the JAX worker's model."""
    return bool(served_models(base_url, api_key))


def run_up(settings: Settings, args: argparse.Namespace, then: list[str]) -> int:
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(settings)
    ran: dict[str, int] = {}  # the `-- CMD`'s exit status, once it has one
    keep_up = bool(getattr(args, "keep_up", False))

    def on_signal(signum, _frame):
        raise KeyboardInterrupt

    def on_hangup(_signum, _frame):
        # SIGHUP is the API's "read --quota-file again" (docs/operations.md §Quotas): one signal to `up` reaches the
        # API process it runs, which logs whether the file was read; the stack keeps running.
        pids = [part.proc.pid for part in stack.parts if part.kind == "api" and part.proc.poll() is None]
        for pid in pids:
            os.kill(pid, signal.SIGHUP)
        console.print(f"{_clock()} SIGHUP passed to the API (pid {', '.join(map(str, pids)) or 'none yet'})")

    signal.signal(signal.SIGTERM, on_signal)  # SIGINT raises KeyboardInterrupt already
    signal.signal(signal.SIGHUP, on_hangup)
    try:
        own_temporal = not settings.is_given("temporal_address")
        if own_temporal:
            settings = _replace_address(settings, f"127.0.0.1:{settings.temporal_port}")
            stack.settings = settings
            stack.start_temporal(settings.temporal_port, settings.ui_port, settings.headless)
            retention = temporal_server.retention_for(settings.store_retention_s)
            asyncio.run(
                temporal_server.set_retention(settings.temporal_address, settings.temporal_namespace, retention)
            )
            console.print(
                f"closed workflows kept {retention.total_seconds() / 86400:g} day(s), as long as the "
                "claim-check store keeps their payloads (--store-retention-s)"
            )
        stack.start_worker("workflow-worker")
        stack.start_worker("jax-worker")
        stack.start_api()
        say_where(settings, stack.base_url, temporal_ui=own_temporal and not settings.headless)
        policy = RestartPolicy(
            base_s=settings.restart_backoff_s,
            cap_s=settings.restart_backoff_max_s,
            max_restarts=settings.crash_loop_restarts,
            window_s=settings.crash_loop_window_s,
        )
        if settings.up_metrics_port:
            from prometheus_client import start_http_server

            start_http_server(settings.up_metrics_port, addr=settings.host)
        if not then:
            console.print("press Ctrl-C to stop")
            return stack.supervise(policy)
        status = _run_then(stack, policy, then)
        if status is None:  # a part crash-looped: the stack stops, whatever --keep-up says
            return 1
        ran["status"] = status
        if keep_up:
            console.print(
                f"{then[0]} exited with {status}; the stack stays up (--keep-up): "
                f"[bold]console[/bold] {stack.base_url}/console · press Ctrl-C to stop"
            )
            stack.supervise(policy)
        return status
    except KeyboardInterrupt:
        return ran.get("status", 0)
    except RuntimeError as e:
        console.print(f"[red]error:[/red] {e}")
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        with console.status("stopping …"):
            stack.stop()
        console.print("stopped")
        if "status" in ran:
            console.print(coming_back(settings))


def _run_then(stack: Stack, policy: RestartPolicy, then: list[str]) -> int | None:
    """Run `-- CMD` against the ready stack, supervising the parts meanwhile: CMD's exit status, or None when a part
    crash-looped first (CMD is then stopped)."""
    env = dict(os.environ, TINKER_BASE_URL=stack.base_url)
    env.setdefault("TINKER_API_KEY", stack.api_key)
    console.print(f"running: {' '.join(then)}")
    command = subprocess.Popen(then, env=env, preexec_fn=die_with_parent(signal.SIGTERM))
    try:
        status = stack.supervise(policy, until=command.poll)
        finished = command.poll() is not None
    finally:
        if command.poll() is None:
            command.terminate()
            command.wait()
    return status if finished else None


def say_where(settings: Settings, base_url: str, *, temporal_ui: bool) -> None:
    """Where a person finds each thing `up` serves, and what their API key means here."""
    console.print(f"[bold]Tinker API[/bold]   {base_url}   (TINKER_BASE_URL={base_url})")
    console.print(f"[bold]Console[/bold]      {base_url}/console")
    console.print(f"[bold]API keys[/bold]     {tenant_mode(bool(settings.accepted_api_keys()))}")
    if temporal_ui:
        console.print(
            f"[bold]Temporal UI[/bold]  http://127.0.0.1:{settings.ui_port}/namespaces/"
            f"{settings.temporal_namespace}/workflows"
        )


def coming_back(settings: Settings) -> str:
    """After `up -- CMD` stopped: how to see what CMD did, since nothing serves it any more."""
    again = sys.argv[0] if Path(sys.argv[0]).name == "tinkerflow" else "tinkerflow"  # as the user typed it
    again += " up"
    for name in ("state_dir", "host", "port"):
        if settings.is_given(name):
            again += f" --{name.replace('_', '-')} {getattr(settings, name)}"
    return (
        f"To see its runs in the console: `{again}`, then open http://{settings.host}:{settings.port}/console "
        f"(they stay in {settings.state_dir}; `up --keep-up -- CMD` stays up after CMD instead)."
    )


def _replace_address(settings: Settings, address: str) -> Settings:
    import dataclasses

    return dataclasses.replace(settings, temporal_address=address)
