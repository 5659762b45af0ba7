"""The usage rows the billing routes and the console's usage page share: kept per training run or sampler, summed
per session for the AdminClient's events."""

from __future__ import annotations

from tinkerflow.api.usage_data import UsageRow, per_session
from tinkerflow.workflows.protocol.usage import OpUsage

HOUR, NEXT = "2026-07-13T14:00:00Z", "2026-07-13T15:00:00Z"


def test_billing_sums_a_sessions_runs_and_samplers_per_hour_and_keeps_the_rest_apart():
    rows = [
        UsageRow(HOUR, "a" * 16, "s1", "tiny", "s1:train:0", OpUsage(training_tokens=3)),
        UsageRow(HOUR, "a" * 16, "s1", "tiny", "s1:train:1", OpUsage(training_tokens=4, checkpoints=1)),
        UsageRow(HOUR, "a" * 16, "s1", "tiny", "s1:sample:0", OpUsage(prefill_tokens=5, sampled_tokens=2)),
        UsageRow(NEXT, "a" * 16, "s1", "tiny", "s1:train:0", OpUsage(training_tokens=6)),
        UsageRow(HOUR, "b" * 16, "s2", "tiny", "s2:train:0", OpUsage(training_tokens=9)),
    ]
    assert per_session(rows) == [
        UsageRow(HOUR, "a" * 16, "s1", "tiny", "", OpUsage(7, 5, 0, 2, 1)),
        UsageRow(HOUR, "b" * 16, "s2", "tiny", "", OpUsage(training_tokens=9)),
        UsageRow(NEXT, "a" * 16, "s1", "tiny", "", OpUsage(training_tokens=6)),
    ]
