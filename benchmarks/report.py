"""Run the benchmarks of the performance table and write docs/benchmarks.md: the table (figure, tinkerflow, engine
alone, ratio, the target, met or not), plots of the two sweeps (PNG beside it) and where a trivial op's time
goes.

    python -m benchmarks.report                         # run all of them, then write the page
    python -m benchmarks.report --only mixed_loop sample_sweep
    python -m benchmarks.report --reuse docs/benchmarks.jsonl               # write the page from earlier results
    python -m benchmarks.report --reuse docs/benchmarks.jsonl --only cold_start   # re-run one, keep the others

Every benchmark runs in its own process (`python -m benchmarks.<name>`) and prints one JSON line per figure; the
report tags each line with its benchmark and keeps them all in --results (default docs/benchmarks.jsonl), so the page
can be written again without measuring. The hand-written reading of the figures (what stands in the way of each
target not met, the next step) is benchmarks/findings.md, and how to run each benchmark is benchmarks/README.md; both
are included as they are.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.report_plots import plot_long_sequences, plot_sweep
from benchmarks.report_sections import control_plane, fmt, paging, prefix_cache

ROOT = Path(__file__).resolve().parent.parent
#: In the order they run and appear; each is `python -m benchmarks.<name>` with these arguments.
BENCHMARKS: dict[str, list[str]] = {
    "cold_start": [],
    "mixed_loop": [],
    "sample_sweep": [],
    "tenant_sweep": [],
    "control_plane": ["--py-spy"],
    "recovery": ["--mode", "restart"],
    "long_sequences": [],
    "paging": [],
    "prefix_cache": ["--repeats", "5"],
    "duty_cycle": [],
    # A short soak for the report (the user's day is `--minutes 60`): every recipe at least once on a warm stack.
    "recipe_soak": ["--minutes", "10"],
}
FINDINGS = Path(__file__).resolve().parent / "findings.md"
RUNNING = Path(__file__).resolve().parent / "README.md"


@dataclass(frozen=True)
class Target:
    """The target for a figure: `field` (tinkerflow, ratio) compared with `bound`; `when` narrows which
    lines it applies to (for instance only the first start)."""

    text: str
    field: str
    op: str  # "<=", "<" or ">="
    bound: float
    when: tuple[tuple[str, object], ...] = ()

    def applies(self, line: dict) -> bool:
        return all(line.get(k) == v for k, v in self.when)

    def met(self, line: dict) -> bool | None:
        value = line.get(self.field)
        if not isinstance(value, int | float):
            return None
        if self.op == "<":
            return value < self.bound
        return value <= self.bound if self.op == "<=" else value >= self.bound


TARGETS: dict[str, Target | tuple[Target, ...]] = {
    "cold_start_up_to_healthy_s": Target("≤ 15 s first start", "tinkerflow", "<=", 15, (("start", "first"),)),
    "cold_start_first_forward_backward_s": Target("≤ 0.5 s", "tinkerflow", "<=", 0.5),
    "cold_start_first_optim_step_s": Target("≤ 0.5 s", "tinkerflow", "<=", 0.5),
    "cold_start_first_sample_s": Target("≤ 1 s", "tinkerflow", "<=", 1.0),
    "mixed_loop_forward_1_datum": Target("≤ 30 ms", "tinkerflow", "<=", 30),
    "mixed_loop_forward_backward_8_datums": Target("≤ 40 ms", "tinkerflow", "<=", 40),
    "mixed_loop_optim_step": Target("≤ 30 ms", "tinkerflow", "<=", 30),
    "mixed_loop_sample_4x32": Target("≤ 60 ms", "tinkerflow", "<=", 60),
    "sample_sweep_tokens_per_s": Target(
        "≥ 50% of the engine alone at 128", "ratio", ">=", 0.5, (("concurrency", 128),)
    ),
    "sample_sweep_scaling": Target("128 calls ≥ 10× one call", "tinkerflow", ">=", 10),
    "tenant_sweep_scaling": Target("8 tenants ≥ 5× one tenant", "tinkerflow", ">=", 5),
    "recovery_kill_to_next_answer_s": Target("≤ 8 s", "tinkerflow", "<=", 8),
    # SkyRL tx 0.4.0 on the same machine and model: 1 token after a prompt of 2K, 8K, 16K tokens.
    "long_sequences_sample_s": tuple(
        Target(f"≤ {bound} s (SkyRL tx)", "tinkerflow", "<=", bound, (("tokens", n),))
        for n, bound in ((2048, 1.5), (8192, 3.1), (16384, 27.0))
    ),
    "long_sequences_memory_gb": Target("< 6 GB at 32K", "tinkerflow", "<", 6, (("tokens", 32768),)),
    "packing_64x50_vs_1x3200": Target("≤ 1.5× one 3,200-token datum", "engine", "<=", 1.5),
    "duty_cycle_engine_busy": (
        Target("≥ 0.95 (4 tenants × 64 × 200)", "tinkerflow", ">=", 0.95, (("tenants", 4),)),
        Target("≥ 0.9 (8 tenants × 8 × 20)", "tinkerflow", ">=", 0.9, (("tenants", 8),)),
    ),
}
#: Keys of a table line that say which variant of its figure it is (shown beside the figure's name).
QUALIFIERS = ("start", "concurrency", "tenants", "vs_concurrency", "vs_tenants", "tokens", "runs", "recipe")


# --- running ----------------------------------------------------------------------------------------------------


def run(names: Iterable[str]) -> list[dict]:
    lines = []
    # One XLA cache for every stack the benchmarks launch (as the test session shares one): each would otherwise
    # compile the same programs again before it is measured. cold_start keeps its own, empty at first, on purpose.
    cache = tempfile.TemporaryDirectory(prefix="tinkerflow-bench-xla-")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TINKER_TELEMETRY="0")
    env.setdefault("TINKERFLOW_COMPILATION_CACHE_DIR", cache.name)
    for name in names:
        t0 = time.perf_counter()
        print(f"report: running benchmarks.{name} …", file=sys.stderr, flush=True)
        proc = subprocess.run(
            [sys.executable, "-m", f"benchmarks.{name}", *BENCHMARKS[name]],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        got = [dict(json.loads(x), bench=name) for x in proc.stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0:
            got.append({"bench": name, "figure": "failed", "returncode": proc.returncode})
        print(f"report: {name}: {len(got)} lines in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        lines += got
    cache.cleanup()
    return lines


def load_average() -> str:
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return "unknown"
    return f"{one:.1f} / {five:.1f} / {fifteen:.1f}"


# --- rendering --------------------------------------------------------------------------------------------------


def _label(line: dict) -> str:
    quals = [f"{k}={line[k]}" for k in QUALIFIERS if k in line]
    return f"`{line['figure']}`" + (f" ({', '.join(quals)})" if quals else "")


def table(lines: list[dict]) -> list[str]:
    out = [
        "| figure | unit | tinkerflow | engine alone | ratio | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for line in lines:
        if "tinkerflow" not in line or "engine" not in line:
            continue
        found = TARGETS.get(line["figure"])
        candidates = found if isinstance(found, tuple) else (found,) if found is not None else ()
        target = next((t for t in candidates if t.applies(line)), None)
        text, met = "", ""
        if target is not None:
            text = target.text
            ok = target.met(line)
            met = "—" if ok is None else ("yes" if ok else "**no**")
        unit = line.get("unit", "×")
        out.append(
            f"| {_label(line)} | {unit} | {fmt(line['tinkerflow'])} | {fmt(line['engine'])} | "
            f"{fmt(line.get('ratio'))} | {text} | {met} |"
        )
    return out


def compile_rows(lines: list[dict]) -> list[str]:
    rows = [
        f"| {_label(x)} | {x['compilations_during_timed_part']} |"
        for x in lines
        if x.get("compilations_during_timed_part") is not None and "tinkerflow" in x
    ]
    return ["| workload | JAX worker compiles while timed |", "|---|---|", *rows] if rows else []


def render(lines: list[dict], docs: Path, meta: dict) -> Path:
    docs.mkdir(parents=True, exist_ok=True)
    md = [
        "# Benchmarks",
        "",
        "Written by `python -m benchmarks.report` (do not edit by hand: how to run the benchmarks is "
        "`benchmarks/README.md` and the reading of the figures `benchmarks/findings.md`, both included below). "
        "Every figure sets tinkerflow (the unmodified tinker SDK against `tinkerflow up` "
        "on the embedded tiny model) beside the engine alone on the same workload, measured in the "
        "same run; ratio = tinkerflow / engine alone (above 1 is slower for times, below 1 is slower for rates).",
        "",
        "Measured (one line per run of the report whose figures are shown):",
        "",
        *[
            f"- {', '.join(r['benchmarks'])}: {r['when']} on {r['machine']}; load average (1/5/15 min) "
            f"{r['load_before']} before, {r['load_after']} after."
            for r in meta.get("runs", [])
        ],
        "",
        *([RUNNING.read_text().rstrip(), ""] if RUNNING.exists() else []),
        "## The table",
        "",
        *table(lines),
        "",
    ]
    compiles = compile_rows(lines)
    if compiles:
        md += ["Compiles during timed parts (the target: no compile inside a workload, ever):", "", *compiles, ""]
    plots = [
        ("sample_sweep_tokens_per_s", "concurrency", "aggregate tokens/s", "benchmarks-sample-sweep.png"),
        ("tenant_sweep_steps_per_s", "tenants", "aggregate steps/s", "benchmarks-tenant-sweep.png"),
    ]
    drawn = [(f, png) for f, x, y, png in plots if plot_sweep(lines, f, x, y, docs / png)]
    if drawn:
        md += ["## The sweeps", ""] + [f"![{f}]({png})\n" for f, png in drawn]
    if plot_long_sequences(lines, docs / "benchmarks-long-sequences.png"):
        md += [
            "## Long sequences",
            "",
            "The embedded tiny model with 40,960 positions (`python -m benchmarks.long_sequences`); the materialised "
            "attention it replaced needed 14 GB at 8K tokens for this model and could not run 16K.",
            "",
            "![long sequences](benchmarks-long-sequences.png)",
            "",
        ]
    pc = prefix_cache(lines)
    if pc:
        md += [
            "## The prefix cache",
            "",
            "Wall time of each workload (median of the timed runs; `python -m benchmarks.prefix_cache`), in the engine "
            "alone with the cache off and on, and through the SDK on a fresh sampling session each run (a cold "
            "cache, as a new GRPO group or conversation has).",
            "",
            *pc,
            "",
        ]
    cp = control_plane(lines)
    if cp:
        md += ["## Where a trivial op's time goes", "", *cp, ""]
    paged = paging(lines)
    if paged:
        md += ["## More runs than slots (paging)", "", *paged, ""]
    failed = [x["bench"] for x in lines if x.get("figure") == "failed"]
    if failed:
        md += [f"Failed to run: {', '.join(failed)} (see its output).", ""]
    if FINDINGS.exists():
        md += [FINDINGS.read_text().rstrip(), ""]
    page = docs / "benchmarks.md"
    page.write_text("\n".join(md))
    return page


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only", nargs="+", choices=list(BENCHMARKS), help="run these benchmarks (default: all, or none with --reuse)"
    )
    parser.add_argument("--reuse", type=Path, help="earlier results (JSONL); lines of benchmarks re-run are replaced")
    parser.add_argument(
        "--results",
        type=Path,
        default=ROOT / "docs" / "benchmarks.jsonl",
        help="where all results are kept (default docs/benchmarks.jsonl)",
    )
    parser.add_argument("--docs", type=Path, default=ROOT / "docs", help="where the page and plots go (default docs/)")
    args = parser.parse_args(argv)
    previous = []
    if args.reuse:
        previous = [json.loads(x) for x in args.reuse.read_text().splitlines() if x.strip()]
    names = args.only or ([] if args.reuse else list(BENCHMARKS))
    meta = next((x for x in previous if x.get("figure") == "report_meta"), {})
    # Earlier runs whose figures are still shown, each naming only those benchmarks now.
    kept = ({**r, "benchmarks": [b for b in r["benchmarks"] if b not in names]} for r in meta.get("runs", []))
    runs = [r for r in kept if r["benchmarks"]]
    when, before = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), load_average()
    fresh = run(names)
    if names:
        machine = f"{os.cpu_count()} CPU cores ({os.uname().machine})"
        runs.append(
            {"when": when, "machine": machine, "load_before": before, "load_after": load_average(), "benchmarks": names}
        )
    lines = [x for x in previous if x.get("bench") not in names and x.get("figure") != "report_meta"] + fresh
    meta = {"figure": "report_meta", "runs": runs}
    order = {name: i for i, name in enumerate(BENCHMARKS)}
    lines.sort(key=lambda x: order.get(x.get("bench", ""), len(order)))  # the page in BENCHMARKS order
    lines.append(meta)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text("".join(json.dumps(x) + "\n" for x in lines))
    page = render([x for x in lines if x.get("figure") != "report_meta"], args.docs, meta)
    print(f"report: wrote {page} and {args.results}", file=sys.stderr)


if __name__ == "__main__":
    main()
