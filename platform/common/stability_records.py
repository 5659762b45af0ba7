"""Stability records (`record_stability_info`): what the server keeps of a sampled sequence so that a
`stable_reinforce` forward_backward can name it by its `sequence_id` (docs/wire-contract.md §StableReinforce).

Two small objects per sample call, in the claim-check store under `stability/`, collected by the store janitor on
the store's retention like request bodies:

- `<sha256(call)>.call`, written by the API before it answers `asample`: the call (`<sample workflow id>#<index>`,
  what its sequence ids `<call>#<i>` share), its body's uri, the owner and session that asked, and the weights the
  sampler samples (sampler, base model, model path, snapshot key).
- `<sha256(body uri)>.sampled`, written by the JAX worker when it has sampled the call and before it answers: each
  sequence's tokens and the sampler's log-probs of them (int32 and float32, little-endian, base64: exact, and about
  11 bytes a token), with the session and weights it used.

Two objects because neither writer knows all of it: the JAX worker never learns a call's place in its workflow (the
API's batcher picks it), and the API never sees the samples. A record is as big as its call's answer, so it is
bounded by the per-request caps (--max-samples-per-request, --max-sample-tokens). Records are the session's:
a training run finds only those of its own session (so never another tenant's), as the SDK documents them
("session-scoped").
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections import OrderedDict
from dataclasses import asdict, dataclass

import numpy as np

from tinkerflow.common.store import ClaimCheckStore, write_whole

log = logging.getLogger(__name__)
KIND = "stability"
FORMAT = 1
CALLS_KEPT = 4  # parsed `.sampled` objects a lookup keeps (a datum's spans name one call, a batch's a few at a time)


@dataclass(frozen=True)
class Weights:
    """Which weights sampled a call: its sampler, and what that sampler samples."""

    sampler_id: str
    base_model: str = ""
    model_path: str = ""  # tinker:// path of saved weights ("" : the base model or an unsaved snapshot)
    snapshot: str = ""  # the engine's snapshot key ("" : the base model)


@dataclass(frozen=True)
class CallRecord:
    """The API's half: which call, which body, whose."""

    call: str
    payload: str
    owner: str
    session_id: str
    weights: Weights


@dataclass(frozen=True)
class SampledSequence:
    tokens: np.ndarray  # int32 [n]
    logprobs: np.ndarray  # float32 [n]


@dataclass(frozen=True)
class Sequence:
    """One recorded sequence, as a training request names it."""

    sequence_id: str
    call: CallRecord
    sampled: SampledSequence


def call_of(sequence_id: str) -> tuple[str, int] | None:
    """(call, index in the call) of a sequence id the API answered (`<call>#<i>`, the call `<workflow id>#<n>`);
    None for any other string."""
    parts = sequence_id.rsplit("#", 2)
    if len(parts) != 3 or not parts[0].startswith("sample/") or not (parts[1].isdigit() and parts[2].isdigit()):
        return None
    return f"{parts[0]}#{int(parts[1])}", int(parts[2])


def _path(store: ClaimCheckStore, key: str, suffix: str) -> str:
    return f"{store.root}/{KIND}/{hashlib.sha256(key.encode()).hexdigest()}.{suffix}"


def _write(store: ClaimCheckStore, path: str, body: dict) -> None:
    store.fs.makedirs(f"{store.root}/{KIND}", exist_ok=True)
    write_whole(store.fs, path, json.dumps({"format": FORMAT, **body}, separators=(",", ":")).encode())


def _read(store: ClaimCheckStore, path: str) -> dict | None:
    try:
        body = json.loads(store.fs.cat_file(path))
    except FileNotFoundError:
        return None
    except ValueError:  # not JSON: never ours (the writes are whole, write_whole)
        log.warning("stability record %s is not JSON; answering it as missing", path)
        return None
    return body if isinstance(body, dict) and body.get("format") == FORMAT else None


def write_call(store: ClaimCheckStore, record: CallRecord) -> None:
    """The API's half of a call's record (blocking I/O: off the event loop)."""
    _write(store, _path(store, record.call, "call"), asdict(record))


def write_sampled(
    store: ClaimCheckStore, payload: str, session_id: str, weights: Weights, sequences: list[SampledSequence]
) -> None:
    """The JAX worker's half: the call's sequences, by its body's uri."""
    encoded = [{"tokens": _b64(s.tokens, "<i4"), "logprobs": _b64(s.logprobs, "<f4")} for s in sequences]
    body = {"payload": payload, "session_id": session_id, "weights": asdict(weights), "sequences": encoded}
    _write(store, _path(store, payload, "sampled"), body)


def _b64(values: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype=dtype).tobytes()).decode()


def _array(text: str, dtype: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype=dtype)


class Lookup:
    """The recorded sequences one training request names, for one session; the few calls read last stay parsed."""

    def __init__(self, store: ClaimCheckStore, session_id: str):
        self.store = store
        self.session_id = session_id
        self._calls: OrderedDict[str, tuple[CallRecord, list[dict]] | None] = OrderedDict()

    def sequence(self, sequence_id: str) -> Sequence | None:
        """The sequence's record, or None: not a sequence id this server answered, not sampled with
        record_stability_info, another session's (another tenant's included), collected after the retention, or its
        sample failed or has not finished."""
        where = call_of(sequence_id)
        if where is None:
            return None
        call, i = where
        found = self._call(call)
        if found is None or not 0 <= i < len(found[1]):
            return None
        try:
            entry = found[1][i]
            tokens, logprobs = _array(entry["tokens"], "<i4"), _array(entry["logprobs"], "<f4")
        except (KeyError, TypeError, ValueError):
            log.warning("stability record of %s is unreadable; answering it as missing", sequence_id, exc_info=True)
            return None
        if len(tokens) != len(logprobs):
            return None
        return Sequence(sequence_id, found[0], SampledSequence(tokens, logprobs))

    def _call(self, call: str) -> tuple[CallRecord, list[dict]] | None:
        if call in self._calls:
            self._calls.move_to_end(call)
            return self._calls[call]
        found = self._read_call(call)
        self._calls[call] = found
        while len(self._calls) > CALLS_KEPT:
            self._calls.popitem(last=False)
        return found

    def _read_call(self, call: str) -> tuple[CallRecord, list[dict]] | None:
        head = _read(self.store, _path(self.store, call, "call"))
        if head is None or head.get("session_id") != self.session_id or head.get("call") != call:
            return None
        try:
            weights = {
                k: str(v) for k, v in dict(head.get("weights") or {}).items() if k in Weights.__dataclass_fields__
            }
            record = CallRecord(
                call=call,
                payload=str(head["payload"]),
                owner=str(head.get("owner", "")),
                session_id=self.session_id,
                weights=Weights(**weights),
            )
        except (KeyError, TypeError, ValueError):
            log.warning("stability record of call %s is unreadable; answering it as missing", call, exc_info=True)
            return None
        sampled = _read(self.store, _path(self.store, record.payload, "sampled"))
        if sampled is None or sampled.get("session_id") != self.session_id or sampled.get("payload") != record.payload:
            return None
        return record, list(sampled.get("sequences", []))
