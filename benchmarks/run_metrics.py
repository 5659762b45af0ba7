"""What recording per-run metric points costs the JAX worker, and what reading them costs the API; one JSON line per
figure. Local store (a temporary directory, as `tinkerflow up` uses), one run, the default bound of points.

    python -m benchmarks.run_metrics                  # 2,000 points recorded, pages of 1,000 read
    python -m benchmarks.run_metrics --points 5000 --max-points 2000
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from benchmarks.common import emit, stats, time_ms
from tinkerflow.common.run_metrics import DEFAULT_MAX_POINTS, RunMetricsStore

RUN = "bench:train:0"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", type=int, default=2000, help="points to record (training ops)")
    p.add_argument("--max-points", type=int, default=DEFAULT_MAX_POINTS, help="the per-run bound")
    p.add_argument("--page", type=int, default=1000, help="points per read (the route's default limit)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = Path(tmp).as_uri()
        store = RunMetricsStore(url, max_points=args.max_points)
        seq = iter(range(1, 10**9))

        def record() -> None:
            n = next(seq)
            metrics = {"loss:sum": 1.0 / n, "tokens": 512, "wall_s": 0.1}
            store.record(RUN, "forward_backward", f"seq:{n}", metrics, seq_id=n, step=n // 2)

        emit(
            figure="run_metrics_record_ms",
            points=args.points,
            max_points=args.max_points,
            **stats(time_ms(record, args.points)),
        )
        kept = store.page(RUN, limit=5000).total_points
        disk = sum(f.stat().st_size for f in (Path(tmp) / "run_metrics").rglob("*") if f.is_file())
        emit(figure="run_metrics_points_kept", points=args.points, kept=kept, disk_bytes=disk)
        reader = RunMetricsStore(url)
        emit(
            figure="run_metrics_page_ms",
            kept=kept,
            page=args.page,
            **stats(time_ms(lambda: reader.page(RUN, limit=args.page), 20)),
        )
        # A restarted worker's first point on a run reads the run's points back (its keys and latest step).
        emit(
            figure="run_metrics_first_record_after_restart_ms",
            kept=kept,
            **stats(time_ms(lambda: RunMetricsStore(url, args.max_points).record(RUN, "sample", "s", {}), 1)),
        )


if __name__ == "__main__":
    main()
