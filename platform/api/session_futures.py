"""The sampling session's futures in the claim-check store, for `retrieve_futures` (docs/wire-contract.md §Futures).

With `sample_use_retrieve_futures` the SDK runs one long-poll per (sampling session, clone) instead of one
`retrieve_future` per sample, and its samples wait for that poll to name them finished. So the server must know, on
any replica and after a restart, which requests a clone has in flight: `asample` writes one small record per request
under `<store>/futures/<sampler>/<clone>/<seq_id>` (the request id it answered, and the poll number that reported
it, 0 until then). A poll lists the clone's records, waits (up to its timeout) until some unreported one has an
outcome, and reports those under the next cursor numbers; records the client says it retrieved are deleted. The
cursor is the count of completions reported: a completion reported in a poll whose answer was lost (its number above
the client's `prev_cursor`) is reported again, one the client has seen never is. The store janitor collects records
(and the folders they leave empty) on the store's retention, like request bodies: a client that never says it
retrieved a future leaves nothing behind for longer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from urllib.parse import quote

from tinkerflow.api import request_ids
from tinkerflow.api.services import Services
from tinkerflow.common.store import write_whole

log = logging.getLogger(__name__)
RELIST_S = 0.5  # how often a held poll looks for requests submitted since it began


def _dir(svc: Services, sampler_id: str, clone: int) -> str:
    return f"{svc.store.root}/futures/{quote(sampler_id, safe='')}/{int(clone)}"


def clone_of(seq_id: int) -> int:
    """The SDK numbers a clone's requests 1_000_000_000 * clone + k (sampling_client.py)."""
    return max(0, int(seq_id)) // 1_000_000_000


def record(svc: Services, sampler_id: str, seq_id: int, request_id: str, payload_uri: str) -> None:
    """Remember an asample's request id (and where its body is, for cancel_future) for its clone's poll. Blocking
    I/O: call it off the event loop."""
    folder = _dir(svc, sampler_id, clone_of(seq_id))
    body = json.dumps({"request_id": request_id, "payload": payload_uri}).encode()
    for attempt in (1, 2):
        svc.store.fs.makedirs(folder, exist_ok=True)
        try:
            write_whole(svc.store.fs, f"{folder}/{int(seq_id):020d}", body)
            return
        except FileNotFoundError:  # the janitor took the folder, empty and old, just now (store.sweep): again
            if attempt == 2:
                raise


def find_payload(svc: Services, sampler_id: str, request_id: str) -> str | None:
    """The body uri of `request_id` among the sampler's records (any clone); None when it has none (retrieved)."""
    base = f"{svc.store.root}/futures/{quote(sampler_id, safe='')}"
    try:
        clones = svc.store.fs.ls(base, detail=False)
    except FileNotFoundError:
        return None
    for folder in clones:
        for rec in _records(svc, str(folder)).values():
            if rec.get("request_id") == request_id:
                return rec.get("payload")
    return None


def _records(svc: Services, folder: str) -> dict[str, dict]:
    out: dict[str, dict] = {}
    try:
        names = svc.store.fs.ls(folder, detail=False)
    except FileNotFoundError:
        return out
    for name in names:
        if str(name).endswith(".partial"):
            continue
        try:
            out[str(name)] = json.loads(svc.store.fs.cat_file(name))
        except (FileNotFoundError, ValueError):
            continue
    return out


async def _state(svc: Services, request_id: str, who: str, wait_s: float) -> str | None:
    """'finished', 'failed', or None while pending (or unreadable: answered by retrieve_future, as always)."""
    from tinkerflow.api.routes_futures import _outcome  # one reader of outcomes for both routes

    try:
        ref = request_ids.decode(request_id, svc.signing_key, who)
        outcome = await asyncio.wait_for(_outcome(svc, ref), timeout=wait_s)
    except TimeoutError:
        return None
    except Exception:  # a failed workflow, a gone one: the payload fetch says what
        return "failed"
    return "finished" if outcome.ok else "failed"


def _forget(svc: Services, path: str) -> None:
    """Remove a retrieved future's record; one a concurrent poll of the same sampler removed first is gone already
    (the SDK's poll retried while the first was still listening)."""
    try:
        svc.store.fs.rm(path)
    except FileNotFoundError:
        pass


async def poll(
    svc: Services, sampler_id: str, clone: int, who: str, prev_cursor: int, timeout: float | None, retrieved: list[str]
) -> tuple[list[dict], int]:
    """(completions, cursor) for one retrieve_futures call (module docstring)."""
    folder = _dir(svc, sampler_id, clone)
    deadline = time.monotonic() + (svc.settings.long_poll_s if timeout is None else max(0.0, min(timeout, 30.0)))
    done_ids = set(retrieved)
    while True:
        records = await asyncio.to_thread(_records, svc, folder)
        for path, rec in list(records.items()):
            if rec["request_id"] in done_ids:
                await asyncio.to_thread(_forget, svc, path)
                del records[path]
        again = {p: r for p, r in records.items() if 0 < r.get("reported", 0) > prev_cursor}
        pending = {p: r for p, r in records.items() if not r.get("reported")}
        left = deadline - time.monotonic()
        wait_s = max(0.01, min(RELIST_S, left))
        states = await asyncio.gather(*(_state(svc, r["request_id"], who, wait_s) for r in pending.values()))
        fresh = [(p, r, s) for (p, r), s in zip(pending.items(), states) if s is not None]
        if fresh or again or left <= 0:
            break
    completions = [{"state": r.get("state", "finished"), "request_id": r["request_id"]} for r in again.values()]
    cursor = max([prev_cursor, *(r["reported"] for r in again.values())])
    for path, rec, state in fresh:
        cursor += 1
        rec.update(reported=cursor, state=state)
        await asyncio.to_thread(write_whole, svc.store.fs, path, json.dumps(rec).encode())
        completions.append({"state": state, "request_id": rec["request_id"]})
    return completions, cursor
