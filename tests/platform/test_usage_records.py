"""The audit log's records in the claim-check store, and `tinkerflow usage`'s price table and tally."""

from __future__ import annotations

from datetime import UTC, date, datetime
from pathlib import Path

import pytest
from tinker import types

from tinkerflow.activities.storage_activities import CLAIM_CHECK_KINDS
from tinkerflow.cli.usage import cost, load_prices, tally
from tinkerflow.common.audit import KIND, AuditLog
from tinkerflow.common.store import ClaimCheckStore

REPO = Path(__file__).resolve().parents[2]


def test_audit_events_are_kept_per_day_and_read_back_as_the_sdks_entries(tmp_path) -> None:
    log = AuditLog(ClaimCheckStore((tmp_path / "store").as_uri()))
    first = log.record("checkpoint_published", "abc123", "tinker://s:train:0/weights/w")
    log.record("checkpoint_ttl_set", "", "tinker://s:train:0/weights/w", ttl_seconds=60)
    today = log.day(first.time.date())
    assert [(e.event, e.key_id) for e in today] == [("checkpoint_published", "abc123"), ("checkpoint_ttl_set", "open")]
    entry = types.AuditLogEntry.model_validate(today[1].entry())
    assert entry.tinker_path == "tinker://s:train:0/weights/w" and entry.model_id == "s:train:0"
    assert entry.event_details == {"key_id": "open", "object": "tinker://s:train:0/weights/w", "ttl_seconds": 60}
    assert log.day(date(2001, 1, 1)) == []
    assert KIND in CLAIM_CHECK_KINDS  # swept after --store-retention-s, like the rest of the store


def test_the_example_price_file_loads_and_prices_per_million_tokens() -> None:
    prices = load_prices(REPO / "docs" / "usage-prices.example.toml")
    table = prices["default"]
    assert table["prefill_cached"] == pytest.approx(table["prefill"] / 5)
    assert cost("prefill", 2_000_000, table) == pytest.approx(2 * table["prefill"])
    assert cost("storage_gb_hours", 720, table) == pytest.approx(table["storage_gb_month"])
    assert cost("train", 1, table) is None  # left to fill in: unpriced, never free
    assert cost("sample", 1, None) is None


def test_a_bad_price_file_is_refused_naming_the_entry(tmp_path) -> None:
    bad = tmp_path / "prices.toml"
    bad.write_text('[default]\nprefill = "cheap"\n')
    with pytest.raises(SystemExit, match=r"\[default\] prefill = 'cheap'"):
        load_prices(bad)


def test_tally_sums_the_sdks_events_by_day_model_and_kind() -> None:
    hour = datetime(2026, 7, 13, 14, tzinfo=UTC)

    def event(info: types.BillingEventInfo) -> types.BillingUsageEvent:
        return types.BillingUsageEvent(bucket_start=hour, bucket_end=hour, base_model="m", event_info=info)

    rows = tally(
        [
            event(types.TrainingBillingEvent(token_count=5)),
            event(types.TrainingBillingEvent(token_count=7)),
            event(types.SamplingPrefillBillingEvent(cached=True, token_count=64)),
            event(types.CheckpointBillingEvent(count=1)),
        ]
    )
    assert rows == {
        ("2026-07-13", "m", "train"): 12,
        ("2026-07-13", "m", "prefill_cached"): 64,
        ("2026-07-13", "m", "checkpoints"): 1,
    }
