"""Quotas and rate limits per API key: what each counts, where it is checked, and how a request past it is refused
(the file's format: tinkerflow.common.quotas; the running tally: quota_tally.py; docs/operations.md §Quotas).

- training_tokens_per_day: the input tokens of forward_backward and forward datums, per UTC day; checked at
  forward_backward; past it the op's future fails with a `user` error.
- sampling_tokens_per_day: prompt and sampled tokens, per UTC day, a call reserving its prompt plus num_samples x
  max_tokens until answered; checked at asample and at the OpenAI and Anthropic endpoints; past it asample's future
  fails (`user`), the endpoints answer 429.
- sampling_tokens_per_minute: the same reservations, in fixed one-minute windows; the same routes; 429.
- concurrent_runs: the key's live training runs; create_model and load_weights creating a run; 429.
- stored_gb: the bytes of the key's current checkpoints (decimal GB); named saves; the op's future fails (`user`).

A 429 carries Retry-After: the seconds until the next UTC day for a daily quota, until the window's end for the rate
limit. In-sequence training ops are never refused at submit (their seq_id must be consumed), so theirs fail through
their future. asample does too for its daily quota: the SDK retries a 429 on asample every second with no end
(tinker's sampling_client.py), so a 429 there would hang the caller until midnight. A request larger than the limit
itself can never pass: 400 (or a failed future). Tokens per minute rather than requests per minute, as hosted
services limit: one request may be one token or 128 samples of 8,192, and tokens are what the engine spends.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING

from fastapi import HTTPException

from tinkerflow.api.quota_tally import Charge, UsageTally
from tinkerflow.api.usage_data import GB, checkpoints_of, day_start
from tinkerflow.common.metrics import QUOTA_REFUSALS, QUOTA_RELOADS
from tinkerflow.common.quotas import Limits, QuotaFile, QuotaFileError, load
from tinkerflow.common.tenancy import key_id
from tinkerflow.workflows.protocol import names

if TYPE_CHECKING:
    from tinkerflow.api.services import Services
    from tinkerflow.common.settings import Settings

log = logging.getLogger(__name__)
RUNS_RETRY_AFTER_S = 30  # a live run ends only when its session does: no time to name, so a while
RECENT_RUN_S = 10.0  # a run created here counts as live this long, however late Temporal's visibility shows it
NO_LIMITS = Limits()


@dataclass(frozen=True)
class Refusal:
    quota: str  # the Limits field
    message: str
    retry_after_s: int
    never: bool = False  # asks more than the limit itself: waiting cannot help

    @property
    def daily(self) -> bool:
        return self.quota.endswith("_per_day")


def too_many(refusal: Refusal) -> HTTPException:
    """A refusal as the synchronous routes answer it: 429 with Retry-After, or 400 for one that can never pass."""
    if refusal.never:
        return HTTPException(400, refusal.message)
    return HTTPException(429, refusal.message, headers={"Retry-After": str(refusal.retry_after_s)})


class Quotas:
    """The API process's quotas (reloaded on SIGHUP), its tally, and the checks the routes call."""

    def __init__(
        self,
        file: QuotaFile | None = None,
        key_of: Callable[[str], str] = lambda key: key,
        accepted: Collection[str] = (),
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ):
        self.path = file.path if file else ""
        self._key_of, self._accepted, self._now = key_of, tuple(accepted), now
        self._default, self._keys = (file.limits(), file.by_key_id(key_of, accepted)) if file else (NO_LIMITS, {})
        self.tally = UsageTally()  # fed by ledger_watch.py
        self._run_locks: dict[str, asyncio.Lock] = {}
        self._recent_runs: dict[str, dict[str, float]] = {}  # tenant -> run workflow id -> created here (monotonic)

    @staticmethod
    def from_settings(settings: Settings, signing_key: Callable[[], bytes]) -> Quotas:
        """The quota file `--quota-file` names; QuotaFileError when it cannot be read (refused at start)."""
        if not settings.quota_file:
            return Quotas()
        file = load(settings.quota_file)
        quotas = Quotas(file, partial(key_id, signing_key()), settings.accepted_api_keys())
        log.info("quotas: %s", quotas.summary())
        return quotas

    @property
    def configured(self) -> bool:
        return self._default != NO_LIMITS or bool(self._keys)

    def summary(self) -> str:
        """What applies, for the log; key ids no accepted key has are named (a typo, or a key since removed)."""
        ids = {self._key_of(key) for key in self._accepted}
        unmatched = sorted(set(self._keys) - ids)
        default = ", ".join(
            f"{f.name} {v:,}" for f in fields(Limits) if (v := getattr(self._default, f.name)) is not None
        )
        note = f" ({', '.join(unmatched)}: no key this server accepts has that id)" if unmatched else ""
        return f"from {self.path}: default {default or 'none'}; {len(self._keys)} key(s) of their own{note}"

    def limits(self, who: str) -> Limits:
        return self._keys.get(who, self._default) if who else self._default

    def reload(self) -> bool:
        """SIGHUP: read the file again; a file that cannot be read keeps the quotas read before."""
        if not self.path:
            log.info("SIGHUP: no --quota-file configured, no quotas to reload")
            return False
        try:
            file = load(self.path)
            keys = file.by_key_id(self._key_of, self._accepted)
        except QuotaFileError as e:
            QUOTA_RELOADS.labels("error").inc()
            log.error("quotas NOT reloaded on SIGHUP, the quotas read before stay in force: %s", e)
            return False
        self._default, self._keys = file.limits(), keys
        QUOTA_RELOADS.labels("ok").inc()
        log.info("quotas reloaded on SIGHUP %s", self.summary())
        return True

    def _refuse(self, who: str, quota: str, message: str, retry_after_s: int, *, never: bool = False) -> Refusal:
        QUOTA_REFUSALS.labels(names.owner_value(who), quota).inc()
        return Refusal(quota, f"{quota} quota: {message}", max(1, retry_after_s), never)

    def _until_tomorrow(self, now: datetime) -> tuple[int, str]:
        left = math.ceil((day_start(now) + timedelta(days=1) - now).total_seconds())
        return left, f"it resets at 00:00 UTC, in {left // 3600}h{left % 3600 // 60:02d}m, or when the quota is raised"

    def admit_training(self, who: str, op: tuple[str, int], count: Callable[[], int]) -> Refusal | Charge | None:
        """A forward_backward `op` (run, seq_id) whose datums hold `count()` input tokens, counted only for a key with
        this quota: charged when admitted, once (None: the key has no such limit, or this op was charged already, the
        SDK sending it again)."""
        limit = self.limits(who).training_tokens_per_day
        tenant = names.owner_value(who)
        if limit is None or self.tally.charged(tenant, op):
            return None
        tokens = count()
        now = self._now()
        day = now.date().isoformat()
        used = self.tally.training(tenant, day)
        if used + tokens <= limit:
            return self.tally.charge_training(tenant, day, tokens, op)
        left, resets = self._until_tomorrow(now)
        if tokens > limit:
            return self._refuse(
                who,
                "training_tokens_per_day",
                f"this op's datums hold {tokens:,} tokens, more than this API key may train in a whole UTC day "
                f"({limit:,}); send fewer per call",
                left,
                never=True,
            )
        return self._refuse(
            who,
            "training_tokens_per_day",
            f"this API key may train {limit:,} tokens a UTC day and has used {used:,} today; this op's datums hold "
            f"{tokens:,} more. {resets}",
            left,
        )

    def refund(self, charge: Charge) -> None:
        """An admitted op or call that was not submitted after all."""
        if charge.minute >= 0:
            self.tally.release_sampling(charge)
        else:
            self.tally.refund_training(charge)

    def bind(self, charge: Charge, workflow_id: str) -> None:
        """The SampleRequest workflow that carries an admitted call: its reservation ends when the ledger read shows
        that workflow closed."""
        self.tally.bind(charge, workflow_id)

    def admit_sampling(self, who: str, tokens: int) -> Refusal | Charge | None:
        """A sampling call reserving `tokens` (prompt + num_samples x max_tokens): reserved when admitted."""
        limits = self.limits(who)
        per_day, per_minute = limits.sampling_tokens_per_day, limits.sampling_tokens_per_minute
        if per_day is None and per_minute is None:
            return None
        now, tenant = self._now(), names.owner_value(who)
        day, minute = now.date().isoformat(), int(now.timestamp() // 60)
        how = "(its prompt plus num_samples x max_tokens)"
        if per_minute is not None:
            used = self.tally.this_minute(tenant, minute)
            if used + tokens > per_minute:
                left = math.ceil(60 - now.timestamp() % 60)
                if tokens > per_minute:
                    return self._refuse(
                        who,
                        "sampling_tokens_per_minute",
                        f"this request reserves {tokens:,} tokens {how}, more than this API key may reserve in a "
                        f"whole minute ({per_minute:,}); lower max_tokens or num_samples",
                        left,
                        never=True,
                    )
                return self._refuse(
                    who,
                    "sampling_tokens_per_minute",
                    f"this API key may reserve {per_minute:,} sampling tokens a minute and has reserved {used:,} "
                    f"this minute; this request reserves {tokens:,} {how}. Retry in {left} s",
                    left,
                )
        if per_day is not None:
            used = self.tally.sampling(tenant, day)
            if used + tokens > per_day:
                left, resets = self._until_tomorrow(now)
                return self._refuse(
                    who,
                    "sampling_tokens_per_day",
                    f"this API key may sample {per_day:,} tokens a UTC day (prompts and sampled tokens; a request "
                    f"holds its reservation until answered) and has {used:,} used or reserved today; this request "
                    f"reserves {tokens:,} {how}. {resets}",
                    left,
                    never=tokens > per_day,
                )
        return self.tally.reserve_sampling(tenant, day, minute, tokens)

    @asynccontextmanager
    async def creating_run(self, svc: Services, who: str, workflow_id: str) -> AsyncIterator[None]:
        """Around the start of a training run: HTTPException (429, or 400 when the limit is 0) past concurrent_runs.
        Creates of one key are serialised here, so a burst cannot all see the same count."""
        limit = self.limits(who).concurrent_runs
        if limit is None:
            yield
            return
        tenant = names.owner_value(who)
        async with self._run_locks.setdefault(tenant, asyncio.Lock()):
            query = f"WorkflowType = 'TrainingRun' AND ExecutionStatus = 'Running' AND {names.OWNER.name} = '{tenant}'"
            live = {wf.id async for wf in svc.client.list_workflows(query)}
            recent = self._recent_runs.setdefault(tenant, {})
            for wf, at in list(recent.items()):
                if time.monotonic() - at > RECENT_RUN_S:
                    del recent[wf]
            live |= set(recent)
            if workflow_id not in live and len(live) >= limit:  # a retried create of a live run is no new run
                raise too_many(
                    self._refuse(
                        who,
                        "concurrent_runs",
                        f"this API key may hold {limit:,} live training runs and holds {len(live):,}; end the "
                        "session of a run you no longer train (or let it time out), then create another",
                        RUNS_RETRY_AFTER_S,
                        never=limit == 0,
                    )
                )
            yield
            recent[workflow_id] = time.monotonic()

    async def storage_refusal(self, svc: Services, who: str) -> Refusal | None:
        """Before a named save: the key's checkpoints already hold its stored_gb (a save's size is known only once
        written, so the save that crosses the limit is the last one let through)."""
        limit = self.limits(who).stored_gb
        if limit is None:
            return None
        stored = sum(m.size_bytes for m in await checkpoints_of(svc, who))
        if stored < limit * GB:
            return None
        return self._refuse(
            who,
            "stored_gb",
            f"this API key may store {limit:g} GB of checkpoints and stores {stored / GB:.3f} GB; delete the ones it "
            "no longer needs (RestClient.delete_checkpoint) or give them a TTL, then save again",
            RUNS_RETRY_AFTER_S,
        )
