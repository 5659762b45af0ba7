"""Metered usage: what one op consumed, and the hourly ledger the workflow that accepts the op keeps of it.

The JAX worker counts an op's usage while it does the work and sends it home inside the op's `Outcome` (the same
signal or batch result as the answer: no second road). The workflow that accepts the answer adds it to its ledger
exactly once: a training run when an op's answer is final (a retried seq_id returns its first answer and adds
nothing; a recovery replay adds nothing), a SampleRequest when its calls are answered (a call lost with its worker is
metered by the call that answered it). The API reads the ledgers for the billing routes (docs/operations.md
§Metering).

Workflow code (stdlib only); every field JSON-friendly, new fields only with defaults (workflows/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta


@dataclass(frozen=True)
class OpUsage:
    """What one op (or a sum of ops) consumed. Prefill counts each sample request's prompt once (its samples share
    it); `prefill_cached_tokens` of those were served from the prefix cache."""

    training_tokens: int = 0  # forward_backward / forward: the datums' input tokens
    prefill_tokens: int = 0  # sampling prompts, cached or not
    prefill_cached_tokens: int = 0  # the part of prefill_tokens the prefix cache served
    sampled_tokens: int = 0  # tokens generated
    checkpoints: int = 0  # named checkpoints saved (not automatic snapshots)
    checkpoint_bytes: int = 0  # bytes those checkpoints stored

    def __add__(self, other: OpUsage) -> OpUsage:
        return OpUsage(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __bool__(self) -> bool:
        return any(getattr(self, f.name) for f in fields(self))

    @property
    def prefill_uncached_tokens(self) -> int:
        return self.prefill_tokens - self.prefill_cached_tokens

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @staticmethod
    def from_dict(raw: dict[str, object]) -> OpUsage:
        """From a memo or a JSON document; unknown keys (a newer writer's) are skipped, missing ones are 0."""
        known = {f.name for f in fields(OpUsage)}
        return OpUsage(**{k: int(v) for k, v in raw.items() if k in known and isinstance(v, int | float)})


def hour_of(t: datetime) -> str:
    """The UTC hour bucket `t` falls in, as the ledgers key it: `2026-07-13T14:00:00Z`."""
    return t.replace(minute=0, second=0, microsecond=0).strftime("%Y-%m-%dT%H:00:00Z")


def hour_start(key: str) -> datetime:
    return datetime.strptime(key, "%Y-%m-%dT%H:00:00Z").replace(tzinfo=UTC)


def hour_end(key: str) -> datetime:
    return hour_start(key) + timedelta(hours=1)


def add_to(ledger: dict[str, OpUsage], hour: str, usage: OpUsage | None) -> None:
    """Add `usage` to `ledger`'s bucket for `hour` (nothing for an empty usage: buckets stay sparse)."""
    if usage:
        ledger[hour] = ledger.get(hour, OpUsage()) + usage


def ledger_memo(ledger: dict[str, OpUsage]) -> dict[str, dict[str, int]]:
    return {hour: usage.as_dict() for hour, usage in sorted(ledger.items())}


def ledger_from_memo(raw: object) -> dict[str, OpUsage]:
    if not isinstance(raw, dict):
        return {}
    return {str(h): OpUsage.from_dict(u) for h, u in raw.items() if isinstance(u, dict)}  # pyright: ignore[reportUnknownVariableType, reportUnknownArgumentType]
