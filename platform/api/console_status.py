"""How the console words a session's or a training run's state for a person: "ended" with its reason, not the
workflow's own status word.

The SDK never finishes its sessions: a script that is done simply stops heartbeating, and its session ends when the
heartbeat timeout passes (status `timed_out`), closing its runs with that reason. That is the normal end of a
client, so it reads "ended · the client went away (no heartbeat for 120s)"; only a run that failed reads "failed".
The words are made here rather than in the workflows, whose status values are recorded in history and in the
`TinkerflowStatus` search attribute.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinkerflow.workflows.protocol.messages import RunState, SessionState

_SESSION_ENDED = "session "  # how SessionWorkflow prefixes the reason it closes its runs with


@dataclass(frozen=True)
class Shown:
    status: str  # active | ready | starting | ended | failed (a run's status word when it is none of those)
    reason: str = ""  # why it ended or failed, for a person ("" while it is alive)


def session_shown(status: str, reason: str) -> Shown:
    """A session's status (`SessionState.status`: active | finished | timed_out) and its recorded reason."""
    if status == "active":
        return Shown("active")
    if status == "timed_out":
        return Shown("ended", f"the client went away ({reason})" if reason else "the client went away")
    return Shown("ended", reason.replace("client finished:", "the client finished it:", 1) if reason else "finished")


def run_shown(status: str, error: str) -> Shown:
    """A run's status (`RunState.status`: starting | ready | failed | closed) and its recorded error or reason."""
    if status != "closed":
        return Shown(status, error)
    if error.startswith(_SESSION_ENDED):  # "session timed_out: no heartbeat for 120s" or "session finished: ..."
        how, _, why = error.removeprefix(_SESSION_ENDED).partition(": ")
        return Shown("ended", f"its session ended: {session_shown(how, why).reason}")
    return Shown("ended", error)


def of_session(s: SessionState) -> Shown:
    return session_shown(s.status, s.reason)


def of_run(s: RunState) -> Shown:
    return run_shown(s.status, s.error)
