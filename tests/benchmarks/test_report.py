"""benchmarks.report writes docs/benchmarks.md and the sweep plots from a fixed JSONL, without running anything."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import report


def _line(bench: str, figure: str, **fields: object) -> dict:
    return {"bench": bench, "figure": figure, **fields}


LINES = [
    _line("cold_start", "cold_start_up_to_healthy_s", unit="s", tinkerflow=12.0, engine=3.0, ratio=4.0, start="first"),
    _line(
        "cold_start", "cold_start_up_to_healthy_s", unit="s", tinkerflow=20.0, engine=2.0, ratio=10.0, start="restart"
    ),
    _line(
        "mixed_loop",
        "mixed_loop_forward_1_datum",
        unit="ms",
        tinkerflow=57.0,
        engine=9.0,
        ratio=6.333,
        compilations_during_timed_part=0,
    ),
    *[
        _line(
            "sample_sweep",
            "sample_sweep_tokens_per_s",
            unit="tok/s",
            tinkerflow=t,
            engine=e,
            ratio=round(t / e, 3),
            concurrency=c,
            compilations_during_timed_part=0,
        )
        for c, t, e in ((1, 900.0, 1000.0), (8, 1400.0, 5000.0), (32, 4000.0, 9000.0), (128, 2800.0, 18000.0))
    ],
    _line("sample_sweep", "sample_sweep_scaling", concurrency=128, vs_concurrency=1, tinkerflow=3.11, engine=18.0),
    *[
        _line(
            "tenant_sweep", "tenant_sweep_steps_per_s", unit="steps/s", tinkerflow=t, engine=2 * t, ratio=0.5, tenants=n
        )
        for n, t in ((1, 7.0), (2, 8.0), (4, 10.0), (8, 11.0))
    ],
    _line("control_plane", "control_plane_forward_1_datum_ms", median_ms=88.0, n=20),
    _line(
        "control_plane",
        "control_plane_hop",
        event="run:WORKFLOW_EXECUTION_UPDATE_ACCEPTED#1",
        median_ms_after_call=12.5,
        ops_with_event=20,
        ops=20,
    ),
    _line("control_plane", "control_plane_api_route_ms", route="/api/v1/forward", mean_ms=9.1, requests_per_op=1.0),
    _line(
        "control_plane",
        "control_plane_cpu_under_mixed_loop",
        part="api",
        cpu_s=1.5,
        wall_s=10.0,
        cpu_share_of_wall=0.15,
        iterations=10,
    ),
    _line(
        "control_plane",
        "control_plane_py_spy_sandbox_start",
        part="workflow-worker",
        frame="_Instance._create_instance",
        share_of_samples=0.05,
    ),
    _line(
        "control_plane",
        "control_plane_py_spy_top_self",
        part="api",
        frame="select (selectors.py:468)",
        share_of_samples=0.25,
    ),
    _line(
        "prefix_cache",
        "prefix_cache_group16_engine",
        unit="ms",
        cache_on=300.0,
        cache_off=900.0,
        speedup=3.0,
        hit_tokens=0,
        served_tokens=7200,
    ),
    _line(
        "prefix_cache",
        "prefix_cache_group16",
        unit="ms",
        tinkerflow=450.0,
        engine=300.0,
        ratio=1.5,
        engine_cache_off=900.0,
        hit_tokens=0,
    ),
]


def test_report_renders_the_table_plots_and_profile_from_earlier_results(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    docs = tmp_path / "docs"

    report.main(["--reuse", str(results), "--results", str(tmp_path / "out.jsonl"), "--docs", str(docs)])

    page = (docs / "benchmarks.md").read_text()
    # One table row per compared figure, with the target and whether it is met.
    assert "| `cold_start_up_to_healthy_s` (start=first) | s | 12 | 3 | 4 | ≤ 15 s first start | yes |" in page
    assert "| `cold_start_up_to_healthy_s` (start=restart) | s | 20 | 2 | 10 |  |  |" in page  # target: first only
    assert "| `mixed_loop_forward_1_datum` | ms | 57 | 9 | 6.33 | ≤ 30 ms | **no** |" in page
    assert "(concurrency=128) | tok/s | 2,800 | 18,000 | 0.156 | ≥ 50% of the engine alone at 128 | **no** |" in page
    assert "(concurrency=8) | tok/s | 1,400 | 5,000 | 0.28 |  |  |" in page
    assert page.count("`tenant_sweep_steps_per_s`") == 4
    # The sweeps are drawn, and the page shows them.
    for png in ("benchmarks-sample-sweep.png", "benchmarks-tenant-sweep.png"):
        assert (docs / png).read_bytes().startswith(b"\x89PNG")
        assert f"]({png})" in page
    # The control-plane section: total, a hop, the API route, CPU per part, a py-spy frame.
    assert "took **88.0 ms** median over 20 ops" in page
    assert "| run:WORKFLOW_EXECUTION_UPDATE_ACCEPTED#1 | 12.5 | 20/20 |" in page
    assert "| `/api/v1/forward` | 9.1 | 1.0 |" in page
    assert "| api | 1.5 | 0.15 |" in page
    assert "- 25.0% `select (selectors.py:468)`" in page
    assert "py-spy, workflow-worker: 5.0% of its samples under `_Instance._create_instance`" in page
    # The prefix cache: the engine alone off and on beside the SDK, in its own table.
    assert "| GRPO group: 16 samples of one 480-token prompt | 900 | 300 | 3 | 7200 | 450 | 1.5 | 0 |" in page
    # Nothing was run: the kept results are the input lines plus the report's own metadata line.
    kept = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert kept[:-1] == LINES
    assert kept[-1]["figure"] == "report_meta"
    assert kept[-1]["runs"] == []  # no run of this report measured anything
