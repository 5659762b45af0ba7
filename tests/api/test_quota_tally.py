"""The quota decisions against the running tally (platform/api/quota_checks.py, quota_tally.py) on a fixed clock, and
the ledger reads that feed the tally and the per-tenant /metrics counters (ledger_watch.py) on a fake Temporal: each
refusal names its quota, limit and usage with the Retry-After its kind implies, one tenant's usage never moves
another's, and the tally settles to what the ledgers metered."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import REGISTRY

from tinkerflow.api.ledger_watch import LedgerWatch, apply
from tinkerflow.api.quota_checks import Quotas, Refusal
from tinkerflow.api.quota_tally import Charge
from tinkerflow.common.quotas import Limits, parse
from tinkerflow.common.settings import Settings
from tinkerflow.workflows.protocol import names
from tinkerflow.workflows.protocol.usage import OpUsage, hour_of, ledger_memo

A, B = "a" * 16, "b" * 16  # the two tenants' key ids
IDS = {"tml-a": A, "tml-b": B}
NOON = datetime(2026, 7, 13, 12, 0, 30, tzinfo=UTC)  # 11 h 59 min 30 s before the next UTC day


@dataclass
class Clock:
    t: datetime = NOON

    def __call__(self) -> datetime:
        return self.t


def make(text: str, clock: Clock) -> Quotas:
    return Quotas(parse(text, "q.toml"), IDS.__getitem__, accepted=tuple(IDS), now=clock)


def counted() -> int:
    raise AssertionError("a key without a training quota has its datums' tokens counted for nothing")


def test_a_training_op_past_the_daily_quota_is_refused_naming_it_and_the_next_day_lets_it_through():
    clock = Clock()
    q = make('[keys."tml-a"]\ntraining_tokens_per_day = 10\n', clock)
    assert isinstance(q.admit_training(A, ("r:train:0", 1), lambda: 6), Charge)
    refusal = q.admit_training(A, ("r:train:0", 2), lambda: 6)
    assert isinstance(refusal, Refusal) and refusal.daily and not refusal.never
    assert refusal.quota == "training_tokens_per_day"
    assert "may train 10 tokens a UTC day and has used 6 today; this op's datums hold 6 more" in refusal.message
    assert refusal.retry_after_s == 11 * 3600 + 59 * 60 + 30 and "in 11h59m" in refusal.message
    assert q.admit_training(B, ("r:train:0", 3), counted) is None  # another tenant: no limit, nothing counted
    assert isinstance(q.admit_training(A, ("r:train:0", 4), lambda: 4), Charge)  # what is left still fits
    clock.t = NOON.replace(hour=0, minute=0, second=1) + timedelta(days=1)
    assert isinstance(q.admit_training(A, ("r:train:0", 5), lambda: 10), Charge)
    never = q.admit_training(A, ("r:train:0", 6), lambda: 11)
    assert isinstance(never, Refusal) and never.never and "more than this API key may train in a whole" in never.message


def test_the_training_tally_is_the_ledger_plus_what_it_does_not_show_yet_in_any_order():
    q = make("[default]\ntraining_tokens_per_day = 100\n", Clock())
    day, hour = NOON.date().isoformat(), hour_of(NOON)
    q.tally.metered(A, hour, OpUsage(training_tokens=40), seeding=True)  # the day so far, read at start
    charge = q.admit_training(A, ("r:train:0", 7), lambda: 30)
    assert isinstance(charge, Charge) and q.tally.training(A, day) == 70
    q.tally.metered(A, hour, OpUsage(training_tokens=30), seeding=False)  # the op metered: counted once
    assert q.tally.training(A, day) == 70
    q.tally.metered(A, hour, OpUsage(training_tokens=20), seeding=False)  # another replica's op
    assert q.tally.training(A, day) == 90
    late = q.admit_training(A, ("r:train:0", 8), lambda: 10)
    assert isinstance(late, Charge) and q.tally.training(A, day) == 100
    q.refund(late)  # never submitted
    assert q.tally.training(A, day) == 90 and q.tally.training(B, day) == 0


def test_sampling_is_limited_per_minute_with_the_windows_end_as_retry_after_and_per_day():
    clock = Clock()
    q = make("[default]\nsampling_tokens_per_minute = 10\nsampling_tokens_per_day = 25\n", clock)
    assert isinstance(q.admit_sampling(A, 7), Charge)
    over = q.admit_sampling(A, 7)
    assert isinstance(over, Refusal) and over.quota == "sampling_tokens_per_minute" and not over.daily
    assert over.retry_after_s == 30 and "has reserved 7 this minute; this request reserves 7" in over.message
    assert isinstance(q.admit_sampling(B, 7), Charge)  # the other key's minute is its own
    clock.t += timedelta(seconds=30)  # the next window
    assert isinstance(q.admit_sampling(A, 7), Charge)
    clock.t += timedelta(minutes=1)
    assert isinstance(q.admit_sampling(A, 7), Charge)  # 21 of 25 today
    clock.t += timedelta(minutes=1)
    daily = q.admit_sampling(A, 7)
    assert isinstance(daily, Refusal) and daily.quota == "sampling_tokens_per_day" and daily.daily
    assert "has 21 used or reserved today; this request reserves 7" in daily.message
    assert daily.retry_after_s == int((datetime(2026, 7, 14, tzinfo=UTC) - clock.t).total_seconds())
    never = q.admit_sampling(A, 11)
    assert isinstance(never, Refusal) and never.never and never.quota == "sampling_tokens_per_minute"


def test_a_reservation_ends_when_its_batch_is_read_closed_and_its_metered_usage_counts_instead():
    clock = Clock()
    q = make("[default]\nsampling_tokens_per_day = 1000\n", clock)
    day, hour = NOON.date().isoformat(), hour_of(NOON)
    first, second, lost = q.admit_sampling(A, 100), q.admit_sampling(A, 100), q.admit_sampling(A, 50)
    assert isinstance(first, Charge) and isinstance(second, Charge) and isinstance(lost, Charge)
    q.bind(first, "sample/x/1")
    q.refund(lost)  # the batch never started
    assert q.tally.sampling(A, day) == 200
    q.tally.metered(A, hour, OpUsage(prefill_tokens=10, sampled_tokens=4), seeding=False)
    q.tally.closed({"sample/x/1", "sample/x/2"})
    assert q.tally.sampling(A, day) == 114  # 14 metered + the second still reserved
    q.bind(second, "sample/x/2")  # read closed before its caller came back: settled at once
    assert q.tally.sampling(A, day) == 14


def test_a_reload_with_a_bad_file_keeps_the_old_quotas_and_a_good_one_raises_them(tmp_path):
    path = tmp_path / "q.toml"
    path.write_text('[keys."tml-a"]\ntraining_tokens_per_day = 5\n')
    settings = Settings(state_dir=tmp_path, quota_file=str(path), api_keys=("tml-a", "tml-b"))
    q = Quotas.from_settings(settings, lambda: b"server-key")
    owner = next(iter(q._keys))  # pyright: ignore[reportPrivateUsage] (the key id the server key gives tml-a)

    def reloads(result: str) -> float:
        return REGISTRY.get_sample_value("tinkerflow_quota_reloads_total", {"result": result}) or 0.0

    before = reloads("error"), reloads("ok")
    path.write_text("[default\n")
    assert not q.reload() and q.limits(owner).training_tokens_per_day == 5
    path.write_text('[keys."tml-a"]\ntraining_tokens_per_day = 1_000\n')
    assert q.reload() and q.limits(owner).training_tokens_per_day == 1000
    assert (reloads("error"), reloads("ok")) == (before[0] + 1, before[1] + 1)
    assert q.limits("") == Limits() and not Quotas().reload()


# --- the ledger reads ------------------------------------------------------------------------------------------------


@dataclass
class _Attrs:
    owner: str

    def get(self, key):
        return self.owner if key == names.OWNER else None


@dataclass
class _Execution:
    id: str
    owner: str
    close_time: datetime | None = None
    memo_usage: dict[str, OpUsage] = field(default_factory=dict[str, OpUsage])
    run_id: str = "r"

    @property
    def typed_search_attributes(self) -> _Attrs:
        return _Attrs(self.owner)

    async def memo(self) -> dict:
        return {"usage": ledger_memo(self.memo_usage)}


class _Temporal:
    """What LedgerWatch asks of Temporal: two visibility listings and each run's `usage` query."""

    def __init__(self):
        self.runs: dict[str, tuple[str, dict[str, OpUsage]]] = {}
        self.samples: list[_Execution] = []
        self.broken: set[str] = set()

    def list_workflows(self, query: str):
        async def listing():
            if "TrainingRun" in query:
                for wf, (owner, _) in self.runs.items():
                    yield _Execution(wf, owner)
            else:
                since = datetime.fromisoformat(query.split("CloseTime >= '")[1].split("'")[0])
                for s in self.samples:
                    if s.close_time is not None and s.close_time >= since:
                        yield s

        return listing()

    def get_workflow_handle(self, wf: str, run_id: str | None = None):
        temporal = self

        class Handle:
            async def query(self, _):
                if wf in temporal.broken:
                    raise RuntimeError("no worker answers")
                return dict(temporal.runs[wf][1])

        return Handle()


def _counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_ledger_reads_seed_the_tally_then_hand_only_growth_to_it_and_the_counters():
    temporal, q = _Temporal(), make("[default]\ntraining_tokens_per_day = 1000\n", Clock())
    hour, day = hour_of(NOON), NOON.date().isoformat()
    tenant = "c" * 16
    temporal.runs["training-run/s:train:0"] = (
        tenant,
        {hour_of(NOON - timedelta(days=1)): OpUsage(9), hour: OpUsage(5)},
    )
    temporal.samples.append(_Execution("sample/1", tenant, NOON, {hour: OpUsage(prefill_tokens=6, sampled_tokens=2)}))
    watch = LedgerWatch(temporal)  # pyright: ignore[reportArgumentType] (the fake answers what it asks)
    labels = {"tenant": tenant}
    before = (
        _counter("tinkerflow_tenant_training_tokens_total", **labels),
        _counter("tinkerflow_tenant_sampling_prompt_tokens_total", **labels, cached="true"),
        _counter("tinkerflow_tenant_sampling_prompt_tokens_total", **labels, cached="false"),
        _counter("tinkerflow_tenant_sampled_tokens_total", **labels),
    )

    seed = asyncio.run(watch.read(NOON))
    assert seed.seeding and seed.closed == {"sample/1"}
    assert seed.grown == {(tenant, hour): OpUsage(training_tokens=5, prefill_tokens=6, sampled_tokens=2)}
    apply(seed, q.tally, NOON)
    assert (q.tally.training(tenant, day), q.tally.sampling(tenant, day)) == (5, 8)

    charge = q.admit_training(tenant, ("r:train:0", 9), lambda: 3)  # accepted between reads, metered before the next
    assert isinstance(charge, Charge) and q.tally.training(tenant, day) == 8
    temporal.runs["training-run/s:train:0"][1][hour] = OpUsage(8)
    temporal.runs["training-run/s:train:1"] = ("d" * 16, {hour: OpUsage(4)})
    temporal.broken.add("training-run/s:train:1")  # cannot answer now: read next time, not lost
    later = NOON + timedelta(seconds=15)
    temporal.samples.append(
        _Execution(
            "sample/2", tenant, later, {hour: OpUsage(prefill_tokens=10, prefill_cached_tokens=4, sampled_tokens=3)}
        )
    )
    grown = asyncio.run(watch.read(later))
    assert not grown.seeding and grown.closed == {"sample/2"}  # sample/1 is not read twice
    assert grown.grown == {(tenant, hour): OpUsage(3, 10, 4, 3)}
    apply(grown, q.tally, later)
    assert q.tally.training(tenant, day) == 8  # the op once, whether read before or after its metering
    assert (
        _counter("tinkerflow_tenant_training_tokens_total", **labels) - before[0],
        _counter("tinkerflow_tenant_sampling_prompt_tokens_total", **labels, cached="true") - before[1],
        _counter("tinkerflow_tenant_sampling_prompt_tokens_total", **labels, cached="false") - before[2],
        _counter("tinkerflow_tenant_sampled_tokens_total", **labels) - before[3],
    ) == (3, 4, 6, 3)  # the seed is the counters' baseline: only growth counts

    temporal.broken.clear()
    again = asyncio.run(watch.read(later + timedelta(seconds=15)))
    assert again.grown == {("d" * 16, hour): OpUsage(4)} and not again.closed


@pytest.mark.parametrize("limit, live, status", [(2, 2, 429), (0, 0, 400)])
def test_concurrent_runs_past_the_quota_are_refused_and_a_retried_create_is_not(limit, live, status):
    from fastapi import HTTPException

    q = make(f"[default]\nconcurrent_runs = {limit}\n", Clock())
    temporal = _Temporal()
    for n in range(live):
        temporal.runs[f"training-run/s:train:{n}"] = (A, {})
    svc = type("Svc", (), {"client": temporal})()

    async def create(wf: str) -> None:
        async with q.creating_run(svc, A, wf):  # pyright: ignore[reportArgumentType] (the fake answers what it asks)
            pass

    with pytest.raises(HTTPException) as e:
        asyncio.run(create("training-run/s:train:9"))
    assert e.value.status_code == status and "concurrent_runs quota" in str(e.value.detail)
    assert status == 400 or e.value.headers == {"Retry-After": "30"}
    if live:
        asyncio.run(create("training-run/s:train:0"))  # the SDK retrying a create it already made
