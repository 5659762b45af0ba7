"""`tinkerflow up` as a supervisor: the restart policy, and the loop on real (tiny, non-tinkerflow) processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tinkerflow.cli.supervise import RESTARTS, CrashLoop, Restart, RestartPolicy, describe_exit, die_with_parent
from tinkerflow.cli.up import Stack, console
from tinkerflow.common.settings import Settings


def test_backoff_doubles_within_the_window_and_caps():
    policy = RestartPolicy(base_s=1, cap_s=5, max_restarts=10, window_s=100)
    delays = [policy.on_exit("jax-worker", t).delay_s for t in (0, 1, 2, 3, 4)]  # pyright: ignore[reportAttributeAccessIssue] (this policy restarts here)
    assert delays == [1, 2, 4, 5, 5]


def test_a_part_that_ran_longer_than_the_window_starts_over_at_the_base_delay():
    policy = RestartPolicy(base_s=1, cap_s=30, max_restarts=3, window_s=60)
    assert policy.on_exit("api", 0) == Restart(delay_s=1, recent=1)
    assert policy.on_exit("api", 10) == Restart(delay_s=2, recent=2)
    assert policy.on_exit("api", 200) == Restart(delay_s=1, recent=1)


def test_more_than_n_restarts_within_the_window_is_a_crash_loop_and_parts_count_apart():
    policy = RestartPolicy(base_s=1, cap_s=30, max_restarts=2, window_s=60)
    assert isinstance(policy.on_exit("temporal", 0), Restart)
    assert isinstance(policy.on_exit("temporal", 1), Restart)
    assert isinstance(policy.on_exit("api", 2), Restart)  # another part has its own count
    assert policy.on_exit("temporal", 2) == CrashLoop(restarts=3, window_s=60)


def test_exit_descriptions_name_the_signal():
    assert describe_exit(-9) == "killed by SIGKILL (-9)"
    assert describe_exit(1) == "exit status 1"


def _wait_for_lines(log, n: int) -> None:
    deadline = time.monotonic() + 60
    while log.read_text().count("up ") < n:
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def _stack(tmp_path) -> Stack:
    return Stack(Settings(state_dir=tmp_path / "state"))


def test_a_killed_part_is_restarted_with_its_command_and_log_and_counted(tmp_path):
    stack = _stack(tmp_path)
    part = stack.start(
        "sleeper", [sys.executable, "-c", "import os, time; print('up', os.getpid(), flush=True); time.sleep(60)"]
    )
    first = part.proc.pid
    _wait_for_lines(part.log_path, 1)
    os.killpg(first, signal.SIGKILL)
    before = RESTARTS.labels("sleeper")._value.get()
    with console.capture() as captured:
        status = stack.supervise(
            RestartPolicy(base_s=0.05, window_s=60),
            until=lambda: 0 if part.restarts and part.proc.poll() is None else None,
        )
    try:
        assert status == 0 and part.proc.pid != first
        facts = json.loads((tmp_path / "state" / "up-parts.json").read_text())
        assert facts["sleeper"] == {"pid": part.proc.pid, "log": str(part.log_path), "restarts": 1}
        assert RESTARTS.labels("sleeper")._value.get() == before + 1
        text = captured.get()
        assert "sleeper exited unexpectedly (killed by SIGKILL (-9)); restarting in 0.1 s" in text
        assert f"Its log: {part.log_path}" in text
        _wait_for_lines(part.log_path, 2)  # the new process writes to the same log
    finally:
        stack.stop()


def test_a_part_that_keeps_dying_stops_the_stack_naming_the_part_and_its_log(tmp_path):
    stack = _stack(tmp_path)
    part = stack.start("flaky", [sys.executable, "-c", "raise SystemExit(3)"])
    with console.capture() as captured:
        status = stack.supervise(RestartPolicy(base_s=0.01, cap_s=0.02, max_restarts=3, window_s=60))
    stack.stop()
    assert status == 1 and part.restarts == 3
    text = captured.get()
    assert "flaky is crash-looping: it exited 4 times within 60 s (last: exit status 3)" in text
    assert str(part.log_path) in text


# --- parts do not outlive `up` ---------------------------------------------------------------------------------------

# A stand-in for `up`: the real Stack starts two parts that would run for minutes, then waits to be killed.
_FAKE_UP = """
import sys, time
from pathlib import Path
from tinkerflow.cli.up import Stack
from tinkerflow.common.settings import Settings

stack = Stack(Settings(state_dir=Path(sys.argv[1])))
for name in ("a", "b"):
    stack.start(name, [sys.executable, "-c", "import time; time.sleep(600)"])
print(" ".join(str(p.proc.pid) for p in stack.parts), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_parts_die_when_up_is_killed_with_sigkill(tmp_path):
    up = subprocess.Popen(
        [sys.executable, "-c", _FAKE_UP, str(tmp_path / "state")], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    assert up.stdout is not None  # stdout=PIPE
    try:
        pids = [int(p) for p in up.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        up.kill()  # SIGKILL: `up` runs no clean-up at all
        up.wait()
        deadline = time.monotonic() + 60  # a bound on a hang, not a timing assertion
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p for p in pids if _alive(p)] == []
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for pid in locals().get("pids", []):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_die_with_parent_is_a_preexec_fn_on_linux():
    preexec = die_with_parent(signal.SIGTERM)
    assert (preexec is not None) == sys.platform.startswith("linux")
