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


def _fmt(value: object) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


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
            f"| {_label(line)} | {unit} | {_fmt(line['tinkerflow'])} | {_fmt(line['engine'])} | "
            f"{_fmt(line.get('ratio'))} | {text} | {met} |"
        )
    return out


def compile_rows(lines: list[dict]) -> list[str]:
    rows = [
        f"| {_label(x)} | {x['compilations_during_timed_part']} |"
        for x in lines
        if x.get("compilations_during_timed_part") is not None and "tinkerflow" in x
    ]
    return ["| workload | JAX worker compiles while timed |", "|---|---|", *rows] if rows else []


def plot_sweep(lines: list[dict], figure: str, x: str, ylabel: str, path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    points = sorted((line[x], line["tinkerflow"], line["engine"]) for line in lines if line.get("figure") == figure)
    if not points:
        return False
    xs = [p[0] for p in points]
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
    ax.plot(xs, [p[1] for p in points], "o-", label="tinkerflow (SDK → up)")
    ax.plot(xs, [p[2] for p in points], "s--", label="engine alone, same workload")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(v) for v in xs])
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel)
    ax.set_title(figure)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def plot_long_sequences(lines: list[dict], path: Path) -> bool:
    """Seconds and memory against tokens: forward_backward and a 1-token sample through the SDK and in the engine
    alone, with the materialised attention's points (where it still fits) for the curve it replaced."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def points(figure: str, field: str, **where) -> list[tuple[int, float]]:
        return sorted(
            (x["tokens"], x[field])
            for x in lines
            if x.get("figure") == figure and field in x and all(x.get(k) == v for k, v in where.items())
        )

    fb_sdk = points("long_sequences_forward_backward_s", "tinkerflow")
    if not fb_sdk:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    for pts, style, label in (
        (fb_sdk, "o-", "forward_backward, tinkerflow"),
        (points("long_sequences_forward_backward_s", "engine"), "s--", "forward_backward, engine alone"),
        (points("long_sequences_sample_s", "tinkerflow"), "o-", "1-token sample, tinkerflow"),
        (points("long_sequences_sample_s", "engine"), "s--", "1-token sample, engine alone"),
        (
            points("long_sequences_reference_attention", "forward_backward_s", attention="reference"),
            "x:",
            "forward_backward, materialised attention",
        ),
    ):
        if pts:
            left.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    for pts, style, label in (
        (points("long_sequences_memory_gb", "tinkerflow"), "o-", "JAX worker high-water (tinkerflow)"),
        (points("long_sequences_memory_gb", "engine"), "s--", "engine-alone process"),
        (
            points("long_sequences_reference_attention", "memory_gb", attention="reference"),
            "x:",
            "materialised attention",
        ),
    ):
        if pts:
            right.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
    for ax, ylabel in ((left, "seconds"), (right, "GB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    left.set_yscale("log")
    left.set_title("time against length")
    right.set_title("memory against length")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def prefix_cache(lines: list[dict]) -> list[str]:
    """The prefix cache's workloads: the engine alone with the cache off and on, and through the SDK (always on)."""
    rows = []
    for name, label in (
        ("group16", "GRPO group: 16 samples of one 480-token prompt"),
        ("conversation6", "6-turn conversation, each turn the last + 80 tokens"),
    ):
        engine = next((x for x in lines if x.get("figure") == f"prefix_cache_{name}_engine"), None)
        sdk = next((x for x in lines if x.get("figure") == f"prefix_cache_{name}"), None)
        if engine is None:
            continue
        through = (_fmt(sdk["tinkerflow"]), _fmt(sdk.get("ratio")), _fmt(sdk.get("hit_tokens"))) if sdk else ("—",) * 3
        served = engine.get("served_tokens", engine["hit_tokens"])
        rows.append(
            f"| {label} | {_fmt(engine['cache_off'])} | {_fmt(engine['cache_on'])} | {_fmt(engine['speedup'])} | "
            f"{_fmt(served)} | {' | '.join(through)} |"
        )
    if not rows:
        return []
    return [
        "| workload (16 new tokens a sample) | engine, cache off (ms) | engine, cache on (ms) | speedup | prompt "
        "tokens served from the cache (engine, every sample) | tinkerflow, cache on (ms) | tinkerflow / engine on | "
        "`prompt_cache_hit_tokens` (SDK, first samples) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def control_plane(lines: list[dict]) -> list[str]:
    out = []
    total = next((x for x in lines if x.get("figure") == "control_plane_forward_1_datum_ms"), None)
    if total:
        out += [
            f"A `forward` of 1 datum through the SDK took **{total['median_ms']} ms** median over {total['n']} ops "
            "(sequential, idle stack). Timeline (median ms after the SDK call; history event times are the "
            "Temporal server's clock):",
            "",
            "| hop (workflow:event#k) | ms after the call | ops with it |",
            "|---|---|---|",
        ]
        out += [
            f"| {x['event']} | {x['median_ms_after_call']} | {x['ops_with_event']}/{x['ops']} |"
            for x in lines
            if x.get("figure") == "control_plane_hop"
        ]
        out.append(f"| result in hand at the SDK | {total['median_ms']} | |")
    routes = [x for x in lines if x.get("figure") == "control_plane_api_route_ms"]
    if routes:
        out += [
            "",
            "API time per route over those ops (its /metrics histogram):",
            "",
            "| route | mean ms at the API | requests per op |",
            "|---|---|---|",
        ]
        out += [f"| `{x['route']}` | {x['mean_ms']} | {x['requests_per_op']} |" for x in routes]
    cpu = [x for x in lines if x.get("figure") == "control_plane_cpu_under_mixed_loop"]
    if cpu:
        out += [
            "",
            f"CPU of each part over {cpu[0]['iterations']} mixed-loop iterations ({cpu[0]['wall_s']} s "
            "wall; 1.0 = one core busy all the time):",
            "",
            "| part | CPU s | share of wall |",
            "|---|---|---|",
        ]
        out += [f"| {x['part']} | {x['cpu_s']} | {x['cpu_share_of_wall']} |" for x in cpu]
    for x in lines:
        if x.get("figure") == "control_plane_py_spy_sandbox_start" and x.get("share_of_samples") is not None:
            out += [
                "",
                f"py-spy, {x['part']}: {x['share_of_samples']:.1%} of its samples under `{x['frame']}` (the "
                "workflow sandbox building a new run's instance, re-importing the modules it does not share).",
            ]
    spy = [x for x in lines if x.get("figure") == "control_plane_py_spy_top_self"]
    for part in dict.fromkeys(x["part"] for x in spy):
        out += ["", f"py-spy, {part}, under the mixed loop: top self-time frames (share of samples on CPU):", ""]
        out += [f"- {x['share_of_samples']:.1%} `{x['frame']}`" for x in spy if x["part"] == part][:8]
    return out


def paging(lines: list[dict]) -> list[str]:
    """More runs than slots: what each level paged and the host memory it took (its steps/s and page ms are rows
    of the table)."""
    rows = [x for x in lines if x.get("figure") == "paging_memory"]
    if not rows:
        return []
    return [
        f"Live runs on {rows[0].get('slots')} adapter slots, training round-robin (one forward_backward of "
        f"{rows[0].get('datums')} datum + optim_step per run per round); the steps/s and page-in/out ms of each level "
        "are the `paging_*` rows of the table. Page-ins per step: what the stack did (its Coordinator pages a run in "
        "for its forward_backward and, when other runs' work took the slots meanwhile, again for its optim_step) and "
        "what the engine alone was given to do the same. Host memory: the page store's bytes after the level, and "
        "the JAX worker's resident set (the engine alone: its process's peak).",
        "",
        "| live runs | creates/s (SDK, 16 at a time) | rounds timed | page-ins per step (stack / engine) | page "
        "store in host memory, MB (stack / engine) | JAX worker RSS, MB | engine alone peak RSS, MB |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {x['runs']:,} | {_fmt(x.get('creates_per_s'))} | {x.get('rounds')} | {x.get('page_ins_per_step')} / "
            f"{x.get('engine_page_ins_per_step')} | {_fmt(x.get('page_store_host_mb'))} / "
            f"{_fmt(x.get('engine_page_store_host_mb'))} | {_fmt(x.get('worker_rss_mb'))} | "
            f"{_fmt(x.get('engine_process_peak_rss_mb'))} |"
            for x in rows
        ],
    ]


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
