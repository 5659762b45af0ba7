"""`tinkerflow usage`: a tenant's metered usage by day and kind, read from a running API with tinker's own AdminClient,
and with `--prices FILE` what the same usage would cost at per-million-token prices (docs/operations.md §Metering).
It asks the API at TINKER_BASE_URL with TINKER_API_KEY, as every tinker program does: a tenant's key shows its own
usage, the operator's (--admin-api-key) everyone's.

The price file is TOML: one table per base model as the API names it (or `default` for the rest), each with USD
prices per million tokens for `prefill` (not served from the prefix cache), `prefill_cached`, `sample` and `train`,
and `storage_gb_month` per GB-month. docs/usage-prices.example.toml is an example to edit.

A kind without a price is shown unpriced, never as free."""

from __future__ import annotations

import argparse
import tomllib
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

EXAMPLE = "docs/usage-prices.example.toml"
KINDS = ("train", "prefill", "prefill_cached", "sample", "checkpoints", "storage_gb_hours")
MAX_DAYS = 14  # one AdminClient window


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "usage",
        help="print a tenant's metered usage by day and kind, and with --prices what it would cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--days", type=int, default=7, help=f"the last N UTC days, today included (1..{MAX_DAYS}; default 7)"
    )
    p.add_argument("--prices", type=Path, help=f"TOML price table in USD per million tokens (example: {EXAMPLE})")


def load_prices(path: Path) -> dict[str, dict[str, float]]:
    """The price table; a SystemExit naming the file and the entry it could not read."""
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise SystemExit(f"--prices {path}: {e}") from None
    prices: dict[str, dict[str, float]] = {}
    for model, table in raw.items():
        if not isinstance(table, dict):
            raise SystemExit(f"--prices {path}: [{model}] must be a table of prices")
        for kind, value in table.items():
            if kind not in (*KINDS, "storage_gb_month") or not isinstance(value, int | float) or value < 0:
                raise SystemExit(f"--prices {path}: [{model}] {kind} = {value!r} is not a price of {', '.join(KINDS)}")
        prices[str(model)] = {str(k): float(v) for k, v in table.items()}
    return prices


def tally(events: list[Any]) -> dict[tuple[str, str, str], float]:
    """(day, base model, kind) -> quantity, from the SDK's BillingUsageEvents."""
    out: dict[tuple[str, str, str], float] = defaultdict(float)
    for e in events:
        info, day, model = e.event_info, e.bucket_start.date().isoformat(), e.base_model or ""
        if info.type == "training":
            out[day, model, "train"] += info.token_count
        elif info.type == "sampling_prefill":
            out[day, model, "prefill_cached" if info.cached else "prefill"] += info.token_count
        elif info.type == "sampling_sample":
            out[day, model, "sample"] += info.token_count
        elif info.type == "checkpoint":
            out[day, model, "checkpoints"] += info.count
        elif info.type == "storage":
            out[day, model, "storage_gb_hours"] += info.gigabyte_hours
    return out


def cost(kind: str, quantity: float, table: dict[str, float] | None) -> float | None:
    if table is None:
        return None
    if kind == "storage_gb_hours":
        rate = table.get("storage_gb_month")
        return None if rate is None else rate * quantity / 720
    rate = table.get(kind)
    return None if rate is None or kind == "checkpoints" else rate * quantity / 1e6


def run_usage(args: argparse.Namespace) -> int:
    import tinker

    if not 1 <= args.days <= MAX_DAYS:
        raise SystemExit(f"--days {args.days}: give 1 to {MAX_DAYS}")
    prices = load_prices(args.prices) if args.prices else None
    now = datetime.now(UTC)
    end = now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    start = end.replace(hour=0) - timedelta(days=args.days - 1)
    admin = tinker.AdminClient()  # TINKER_BASE_URL and TINKER_API_KEY, as every tinker program reads them
    usage = admin.get_billing_usage(start, end).result()
    rows = tally(usage.data)
    if not rows:
        print(f"no metered usage from {start:%Y-%m-%d} to now")
        return 0
    total: float = 0.0
    unpriced = False
    print(
        f"{'day':<10}  {'base model':<28}  {'kind':<16}  {'quantity':>14}"
        + ("  {:>12}".format("USD") if prices else "")
    )
    for (day, model, kind), quantity in sorted(rows.items()):
        shown = f"{quantity:,.3f}" if kind == "storage_gb_hours" else f"{int(quantity):,}"
        line = f"{day:<10}  {model[-28:]:<28}  {kind:<16}  {shown:>14}"
        if prices is not None:
            usd = cost(kind, quantity, prices.get(model) or prices.get("default"))
            if usd is None and kind != "checkpoints":
                unpriced = True
            total += usd or 0.0
            line += f"  {'unpriced' if usd is None else f'{usd:,.4f}':>12}"
        print(line)
    if prices is not None:
        print(
            f"would cost about ${total:,.2f} at the prices in {args.prices}"
            + (" (some kinds unpriced)" if unpriced else "")
        )
    return 0
