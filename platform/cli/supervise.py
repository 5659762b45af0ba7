"""How `tinkerflow up` keeps its parts alive: restart what exits unexpectedly, give up only on a crash loop.

On one machine `up` is the supervisor Kubernetes is elsewhere (docs/architecture.md §What durability promises). The
decision (restart now, later, or stop everything) is a pure function of when a part exited before, so it is tested
without processes; `up.py` owns the processes and calls `RestartPolicy.on_exit` each time one of them ends.

`up`'s parts must not outlive it: a signal to `up` stops them (up.py), and on Linux each part also asks the kernel to
signal it when `up` dies (`die_with_parent`), so even a SIGKILL of `up` leaves nothing running.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter

RESTARTS = Counter(
    "tinkerflow_up_restarts_total", "parts of `tinkerflow up` restarted after an unexpected exit", ["part"]
)


@dataclass(frozen=True)
class Restart:
    """Start the part again after `delay_s`; `recent` restarts of it (this one included) fall in the window."""

    delay_s: float
    recent: int


@dataclass(frozen=True)
class CrashLoop:
    """The part exited `restarts` times within `window_s`: stop the stack and say so."""

    restarts: int
    window_s: float


@dataclass
class RestartPolicy:
    """Exponential backoff per part (base, doubled per restart still in the window, capped); a crash loop when a
    part needs more than `max_restarts` restarts within `window_s` seconds. A part that ran longer than the window
    since its last restart starts over at the base delay."""

    base_s: float = 1.0
    cap_s: float = 30.0
    max_restarts: int = 5
    window_s: float = 300.0
    _history: dict[str, deque[float]] = field(default_factory=dict)

    def on_exit(self, part: str, now: float) -> Restart | CrashLoop:
        history = self._history.setdefault(part, deque())
        while history and now - history[0] > self.window_s:
            history.popleft()
        if len(history) >= self.max_restarts:
            return CrashLoop(restarts=len(history) + 1, window_s=self.window_s)
        history.append(now)
        delay = min(self.cap_s, self.base_s * 2 ** (len(history) - 1))
        return Restart(delay_s=delay, recent=len(history))


def describe_exit(returncode: int) -> str:
    """'killed by SIGKILL (-9)' / 'exit status 1': what a person reads in the log line."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name} ({returncode})"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None  # not Linux (no prctl): a signal to `up` still stops its parts; a SIGKILL of it cannot


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` that has the child receive `sig` when the process that spawns it dies (PR_SET_PDEATHSIG;
    kept across exec). None where the platform has no prctl. Everything it needs is looked up here, in the parent:
    between fork and exec the child only calls prctl, getppid and kill."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the parent died between fork and prctl: nobody will send the signal
            os.kill(os.getpid(), sig)

    return preexec
