"""A soak that is the user's day: tinker-cookbook 0.6.1's own recipes, one after another, in a loop, against one
stack for `--minutes`, and how the stack holds up over that time.

The recipes are the families tests/e2e/cookbook drives, each through its own CLI (`python -m <recipe> key=value`,
unmodified, as a user runs it; only the hub-only settings are overridden as those tests do: the served tiny model,
`renderer_name=role_colon`, local or cached data, small sizes): supervised chat (chat_sl), prompt_distillation,
DPO on Anthropic/hh-rlhf (a synthetic copy in a local datasets cache, tests/e2e/cookbook/hf_offline.py), RL from
pairwise preferences (preference.shorter), math_rl's arithmetic env, and the guess_number and text_arena games.
Each run trains `--steps` steps, then the next recipe starts; a recipe's k-th run takes the k-th of SHAPES (group
size, batch size, max_tokens, prompt padding), so the stack keeps meeting new shapes as a real day brings them.
(twenty_questions is not among them: its answerer is a hub model its CLI cannot point at the served one.)

Every `--sample-s` the JAX worker is sampled (benchmarks/soak_probe.py): its pid and `up`'s restarts of it, memory
mappings, resident set, programs held, compiles. A stack it launches is watched from its steady state on: the soak
starts once the worker's background warm-up has finished, so every compile counted is one the day's traffic (or a
restarted worker) caused.

    python -m benchmarks.recipe_soak --minutes 60 [--recipes chat_sl math_rl …] [--steps 2] [--out FILE]
    python -m benchmarks.recipe_soak --stack-url URL --state-dir DIR --metrics-url URL/metrics   # a running stack
    python -m benchmarks.recipe_soak --minutes 0 --max-runs 1 --recipes chat_sl --steps 1 --stack-arg=--warm-up=off

`--minutes` (fractions allowed) is how long new runs start; the run in flight then finishes. `--max-runs` stops
earlier. `--out` (default .tinkerflow/bench/recipe_soak-<UTC time>.json) gets the figures, every run, every restart
and the time series; the folder of the same name gets each run's output and log_path, and the stack's logs. A stack
it launches serves the JAX worker's /metrics on a free port; `--stack-arg` passes a flag to that `tinkerflow up`
(`--stack-arg=--warm-up=off`: a steady state at once, what the smoke test uses). With `--stack-url`, `--state-dir`
(its state dir on this machine) gives the worker's pid, log and restarts, and `--metrics-url` its /metrics; what
neither gives reads null.

Figures (one JSON line each; `tinkerflow` holds the figure):
* `recipe_soak_steps_per_min`: training steps per minute of each recipe's own runs (`recipe`), and of the whole soak
  (`recipe=all`, between-run start-up included), with the first and last run's (or half's) rate beside it.
* `recipe_soak_worker_restarts`: times `up` restarted the JAX worker, with each exit's cause (up.log, log tail).
* `recipe_soak_programs_compiled_after_warm_up` / `recipe_soak_compile_s_after_warm_up`: programs the worker built
  on the day's traffic after its warm-up, and their seconds (its log; a restarted worker's own warm-up apart).
* `recipe_soak_memory_mappings` / `recipe_soak_worker_rss_mb`: first, last, max, and the spread over the run's last
  half (flat at steady state; a climb is programs piling up or a leak).
* `recipe_soak_stack_log_errors`: ERROR / Traceback lines the stack's parts logged during the soak.
The full time series, every run and every restart go to `--out` (JSON). There is no engine-alone baseline: the
figures are the stack's own behaviour over time, not a workload the engine could run alone (`engine` is null).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

from benchmarks import soak_probe
from benchmarks.common import emit, running_stack, served_model
from benchmarks.soak_probe import Probe, Sampler, flatness, log_errors

ROOT = Path(__file__).resolve().parent.parent
API_KEY = "tml-bench-key"
log = logging.getLogger("benchmarks.recipe_soak")


@dataclass(frozen=True)
class Shape:
    """One run's sizes: RL group size, batch (groups or examples), sampled tokens, filler words before each prompt."""

    group: int
    batch: int
    tokens: int
    pad: int


SHAPES = (Shape(2, 2, 12, 0), Shape(4, 4, 24, 24), Shape(3, 2, 40, 96), Shape(2, 4, 16, 240))
# name: (module, its CLI arguments as the e2e cookbook tests pass them, with sizes from the run's Shape). The CLIs
# that take no base_url read TINKER_BASE_URL, as a user's do; dpo's `hhh` is the cache HF_DATASETS_CACHE names.
RECIPES = {
    "chat_sl": (
        "tinker_cookbook.recipes.chat_sl.train",
        "renderer_name=role_colon dataset={conversations} batch_size={batch2} {length} eval_every=0 save_every=0",
    ),
    "prompt_distillation": (
        "tinker_cookbook.recipes.prompt_distillation.train",
        "renderer_name=role_colon file_path={labelled} batch_size={batch2} num_epochs=1 {length} eval_every=0 "
        "save_every=0",
    ),
    "dpo": (
        "tinker_cookbook.recipes.preference.dpo.train",
        "renderer_name=role_colon dataset=hhh batch_size={batch2} {length} learning_rate=1e-3 lr_schedule=constant",
    ),
    "shorter": (
        "tinker_cookbook.recipes.preference.shorter.train",
        "renderer_name=role_colon batch_size={batch} group_size={group} max_tokens={tokens} eval_every=0",
    ),
    "math_rl": (
        "tinker_cookbook.recipes.math_rl.train",
        "renderer_name=role_colon env=arithmetic group_size={group} groups_per_batch={batch} max_tokens={tokens} "
        "eval_every=0 save_every=0",
    ),
    "guess_number": (
        "tinker_cookbook.recipes.multiplayer_rl.guess_number.train",
        "renderer_name=role_colon batch_size={batch} group_size={group} max_tokens={tokens} eval_every=0 save_every=0",
    ),
    # The qwen3 renderer, as its test: every move is parsed from the recipe's stop list.
    "text_arena": (
        "tinker_cookbook.recipes.multiplayer_rl.text_arena.train",
        "renderer_name=qwen3 batch_size={batch} num_train_datapoints={games} num_test_datapoints=2 max_tokens={tokens} "
        "eval_every=0 save_every=0",
    ),
}


def recipe_args(name: str, s: Shape, model: str, steps: int, data: Path) -> list[str]:
    """The CLI arguments of one run of `name` at shape `s`."""
    template = RECIPES[name][1].split()  # split before filling in: a path may hold spaces
    # max_length leaves room for the padded prompts: nothing is cut to one length.
    values: dict[str, Any] = dict(
        batch=s.batch,
        batch2=2 * s.batch,
        group=s.group,
        tokens=s.tokens,
        games=s.batch * steps,
        length=f"max_length={64 + 4 * s.pad}",
    )
    if name == "chat_sl":
        values["conversations"] = soak_probe.conversations(data, s.pad)
    if name == "prompt_distillation":
        values["labelled"] = soak_probe.labelled(data, s.pad)
    base = [f"model_name={model}", f"max_steps={steps}", "behavior_if_log_dir_exists=delete"]
    return base + [t.format(**values) for t in template]


def steps_done(log_path: Path, steps: int) -> int:
    """Training steps a run has logged (metrics.jsonl, as the tests read it): distinct steps below `steps` (RL loops
    add a last row at step max_steps for their final checkpoint)."""
    path = log_path / "metrics.jsonl"
    if not path.exists():
        return 0
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            continue
    return len({r["step"] for r in rows if isinstance(r.get("step"), int) and r["step"] < steps})


def run_one(module: str, args: list[str], log_file: Path, env: dict[str, str], timeout_s: float) -> int | str:
    """Run one recipe CLI in its own process group; its exit status, or "timeout" (then it was killed)."""
    with open(log_file, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return "timeout"
    finally:
        if proc.poll() is None:  # timed out, or the soak was interrupted: the run goes with it
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def soak(
    args: argparse.Namespace, base_url: str, model: str, probe: Probe, work: Path, stack, runs: list[dict]
) -> None:
    """The loop: recipes in turn until --minutes have passed (a run in flight then finishes) or --max-runs ran; each
    run's record is appended to `runs`."""
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    (work / "runs").mkdir(exist_ok=True)
    env = dict(os.environ, TINKER_BASE_URL=base_url, TINKER_API_KEY=args.api_key, TINKER_TELEMETRY="0")
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    now: dict[str, Any] = {"recipe": None, "log_path": None, "steps": 0}
    lock = threading.Lock()

    def context() -> dict[str, Any]:
        with lock:
            path = now["log_path"]
            return {"recipe": now["recipe"], "steps": now["steps"] + (steps_done(path, args.steps) if path else 0)}

    t0 = time.monotonic()
    with Sampler(probe, args.sample_s, context), contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: figures so far
        while not (args.max_runs and len(runs) >= args.max_runs):
            if args.minutes and time.monotonic() - t0 >= args.minutes * 60:
                break
            if stack is not None and stack.proc.poll() is not None:
                log.error("recipe_soak: `tinkerflow up` exited (%s): the soak stops", stack.proc.returncode)
                break
            name = args.recipes[len(runs) % len(args.recipes)]
            shape = SHAPES[sum(r["recipe"] == name for r in runs) % len(SHAPES)]
            log_path = work / "runs" / f"{len(runs):03d}-{name}"
            cli = recipe_args(name, shape, model, args.steps, data)
            run_env = env
            if name == "dpo":
                run_env = dict(env, HF_DATASETS_CACHE=str(soak_probe.hh_rlhf_cache(data, shape.pad)))
            with lock:
                now.update(recipe=name, log_path=log_path)
            start = time.monotonic()
            log.info("recipe_soak: run %d: %s at %s", len(runs), name, shape)
            status = run_one(
                RECIPES[name][0],
                [*cli, f"log_path={log_path}"],
                log_path.with_suffix(".log"),
                run_env,
                args.recipe_timeout_s,
            )
            steps = steps_done(log_path, args.steps)
            run = {
                "recipe": name,
                "shape": asdict(shape),
                "start_s": round(start - t0, 1),
                "wall_s": round(time.monotonic() - start, 1),
                "steps": steps,
                "status": status,
                "log": str(log_path.with_suffix(".log")),
            }
            if status != 0:
                tail = log_path.with_suffix(".log").read_text(errors="replace").splitlines()[-25:]
                run["output_tail"] = tail
                log.warning("recipe_soak: %s failed (%s) after %d steps:\n%s", name, status, steps, "\n".join(tail))
            log.info("recipe_soak: %s: %d steps in %.0f s (%s)", name, steps, run["wall_s"], status)
            runs.append(run)
            with lock:
                now.update(recipe=None, log_path=None, steps=now["steps"] + steps)


def per_min(steps: int, seconds: float) -> float | None:
    return round(60 * steps / seconds, 2) if seconds > 0 else None


def figures(runs: list[dict], wall_s: float, probe: Probe, errors: dict | None, common: dict) -> list[dict]:
    """The JSON lines of the module docstring."""
    lines = []
    for name in dict.fromkeys(r["recipe"] for r in runs):
        mine = [r for r in runs if r["recipe"] == name]
        steps, secs = sum(r["steps"] for r in mine), sum(r["wall_s"] for r in mine)
        lines.append(
            {
                "figure": "recipe_soak_steps_per_min",
                "unit": "steps/min",
                "recipe": name,
                "tinkerflow": per_min(steps, secs),
                "steps": steps,
                "recipe_runs": len(mine),
                "failed": sum(r["status"] != 0 for r in mine),
                "wall_s": round(secs, 1),
                "first_run_steps_per_min": per_min(mine[0]["steps"], mine[0]["wall_s"]),
                "last_run_steps_per_min": per_min(mine[-1]["steps"], mine[-1]["wall_s"]),
            }
        )
    halves = [[r for r in runs if (r["start_s"] < wall_s / 2) == first] for first in (True, False)]
    rates = [per_min(sum(r["steps"] for r in h), sum(r["wall_s"] for r in h)) for h in halves]
    lines.append(
        {
            "figure": "recipe_soak_steps_per_min",
            "unit": "steps/min",
            "recipe": "all",
            "tinkerflow": per_min(sum(r["steps"] for r in runs), wall_s),
            "steps": sum(r["steps"] for r in runs),
            "recipe_runs": len(runs),
            "failed": sum(r["status"] != 0 for r in runs),
            "wall_s": round(wall_s, 1),
            "first_half_steps_per_min": rates[0],
            "last_half_steps_per_min": rates[1],
        }
    )
    lines.append(
        {
            "figure": "recipe_soak_worker_restarts",
            "unit": "restarts",
            "tinkerflow": len(probe.restarts) if probe.state_dir else None,
            "causes": [r["up_says"] or r["worker_log_tail"][-3:] for r in probe.restarts],
        }
    )
    last = probe.series[-1] if probe.series else {}
    reader = probe.log
    compiled = sum(reader.traffic.values()) if reader else last.get("metrics_compiles")
    lines.append(
        {
            "figure": "recipe_soak_programs_compiled_after_warm_up",
            "unit": "programs",
            "tinkerflow": compiled,
            "source": "log" if reader else "metrics",
            "by_program": dict(reader.traffic) if reader else None,
            "restart_warm_up_compiles": reader.restart_warm_up if reader else None,
            "metrics_compiles": last.get("metrics_compiles"),
            "evictions": last.get("metrics_evictions"),
            "recompiles": last.get("metrics_recompiles"),
            "programs_held": last.get("programs_held"),
        }
    )
    lines.append(
        {
            "figure": "recipe_soak_compile_s_after_warm_up",
            "unit": "s",
            "tinkerflow": round(reader.traffic_s, 2) if reader else last.get("metrics_compile_s"),
            "restart_warm_up_s": round(reader.restart_warm_up_s, 2) if reader else None,
            "metrics_compile_s": last.get("metrics_compile_s"),
        }
    )
    for key, figure, unit in (
        ("mappings", "recipe_soak_memory_mappings", "mappings"),
        ("rss_mb", "recipe_soak_worker_rss_mb", "MB"),
    ):
        flat = flatness(probe.series, key)
        lines.append({"figure": figure, "unit": unit, "tinkerflow": flat["last"], **flat})
    lines.append(
        {
            "figure": "recipe_soak_stack_log_errors",
            "unit": "lines",
            "tinkerflow": None if errors is None else sum(e["count"] for e in errors.values()),
            "by_log": {k: e["count"] for k, e in (errors or {}).items()},
        }
    )
    return [{**x, "engine": None, "ratio": None, **common} for x in lines]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0, help="new runs start for this long (60; fractions ok)")
    parser.add_argument(
        "--recipes",
        nargs="+",
        choices=list(RECIPES),
        default=list(RECIPES),
        metavar="NAME",
        help=f"which, in turn (default all: {' '.join(RECIPES)})",
    )
    parser.add_argument("--steps", type=int, default=2, help="training steps per run (default 2)")
    parser.add_argument("--max-runs", type=int, default=0, help="stop after this many runs (default 0: no limit)")
    parser.add_argument("--sample-s", type=float, default=15.0, help="seconds between samples (default 15)")
    parser.add_argument("--recipe-timeout-s", type=float, default=1800.0, help="a run is killed past this (1800)")
    parser.add_argument("--out", type=Path, help="the JSON time series (.tinkerflow/bench/recipe_soak-<UTC>.json)")
    parser.add_argument("--stack-url", help="soak a running stack instead of launching one")
    parser.add_argument("--api-key", default=API_KEY, help="the stack's API key (a launched one gets this one)")
    parser.add_argument("--state-dir", type=Path, help="with --stack-url: its state dir here (up-parts.json, logs/)")
    parser.add_argument("--metrics-url", help="with --stack-url: its JAX worker's /metrics (--metrics-port)")
    parser.add_argument("--stack-arg", action="append", default=[], help="a flag for the launched `up` (repeatable)")
    args = parser.parse_args(argv)
    if not args.minutes and not args.max_runs:
        parser.error("--minutes 0 runs until --max-runs: give one of them")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per /metrics scrape would bury the soak's own
    started = dt.datetime.now(dt.UTC)
    out = args.out or ROOT / ".tinkerflow" / "bench" / f"recipe_soak-{started:%Y%m%d-%H%M%S}.json"
    work = out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    from tinkerflow.cli.launch import free_port

    port = None if args.stack_url else free_port()
    extra = [] if args.stack_url else ["--metrics-port", str(port), *args.stack_arg]
    with running_stack(args.stack_url, args.api_key, extra) as (base_url, stack):
        state_dir = stack.state_dir if stack is not None else args.state_dir
        probe = Probe(state_dir, f"http://127.0.0.1:{port}/metrics" if port else args.metrics_url)
        warm_up_wait_s = probe.wait_for_warm_up(1800.0)
        model = served_model(base_url, args.api_key)
        offsets = {p: p.stat().st_size for p in (state_dir.glob("**/*.log") if state_dir else ())}
        probe.start()
        probe.sample(recipe=None, steps=0)
        t0, runs = time.monotonic(), []
        try:
            soak(args, base_url, model, probe, work, stack, runs)
        finally:
            wall_s = time.monotonic() - t0
            probe.sample(recipe=None, steps=sum(r["steps"] for r in runs))
            errors = log_errors(offsets) if state_dir is not None else None
            if state_dir is not None:  # a launched stack's state dir goes with it: keep its logs beside the runs
                shutil.copytree(state_dir / "logs", work / "stack-logs", dirs_exist_ok=True)
    common = {"minutes": args.minutes, "steps_per_run": args.steps, "warm_up_wait_s": warm_up_wait_s}
    lines = figures(runs, wall_s, probe, errors, common)
    for line in lines:
        emit(**line)
    record = {"started": started.isoformat(), "args": {k: str(v) for k, v in vars(args).items()}, "figures": lines}
    record.update(base_url=base_url, warm_up_wait_s=warm_up_wait_s, runs=runs, restarts=probe.restarts)
    out.write_text(json.dumps({**record, "log_errors": errors, "series": probe.series}, indent=1))
    print(f"recipe_soak: wrote {out} (runs' output in {work})", file=sys.stderr)


if __name__ == "__main__":
    main()
