"""What benchmarks.recipe_soak watches on the stack while the recipes run: the JAX worker's pid and restarts
(`<state-dir>/up-parts.json`, as `up` writes it), its memory mappings and resident set, its compiles (its /metrics
when served there, else its log's aot_cache lines) and why it died when it did (up.log and the worker log's tail).

A Probe is read from one thread (the soak's sampler); the figures come from the time series it collects
(`summarize`)."""

from __future__ import annotations

import collections
import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("benchmarks.recipe_soak")

PART = "jax-worker"
# aot_cache's line per program built (workers/engine/runtime/aot_cache.py): its name, then the seconds it took.
COMPILED = re.compile(r"aot_cache: compiled (.+?) for .* in ([0-9.]+)s")
# Every JAX worker process logs this once, after loading the model and before compiling anything (engine.py): what
# follows in the log is that process's.
PROCESS_START = "tinkerflow.workers.engine.engine: loaded "
# The process's background warm-up is over (jax_worker.py): the last line of it, or the readiness line saying none
# was left for the background.
WARM_UP_DONE = re.compile(r"background warm-up done|JAX worker engine ready: .*, 0 after")
# What a JAX worker process logs at its start before PROCESS_START, and progress bars: not why the one before died.
STARTUP = re.compile(r"persistent_cache: XLA persistent|tiny_model: |host_memory: vm\.max_map_count|PyTorch was not")
PROGRESS = re.compile(r"it/s\]|tensor/s\]|\d+%\|")
# Prometheus series of the JAX worker (workers/host_memory.py; docs/metrics.md §Host memory series).
SERIES = {
    "tinkerflow_worker_memory_mappings": "mappings",
    "tinkerflow_worker_programs_compiled": "programs_held",
    "tinkerflow_worker_program_compiles_total": "compiles",
    "tinkerflow_worker_program_compile_seconds_total": "compile_s",
    "tinkerflow_worker_program_evictions_total": "evictions",
    "tinkerflow_worker_program_recompiles_total": "recompiles",
}
COUNTERS = ("compiles", "compile_s", "evictions", "recompiles")  # per process: they restart from 0 with it


def count_lines(path: Path) -> int | None:
    """Lines of a /proc/<pid>/maps (one a mapping), counted in binary chunks; None once the process is gone."""
    try:
        with open(path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return None


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def scrape(url: str) -> dict[str, float]:
    """The JAX worker's SERIES now ({short name: value}); {} where /metrics does not answer or lacks them."""
    import httpx

    try:
        text = httpx.get(url, timeout=10).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in SERIES:
            out[SERIES[name]] = float(value)
    return out


@dataclass
class LogReader:
    """The JAX worker's log from an offset on, read as it grows: the compiles in it, split into those on traffic and
    those of a restarted process's own warm-up (from its PROCESS_START line to its WARM_UP_DONE line)."""

    path: Path
    offset: int = 0
    in_restart_warm_up: bool = False
    traffic: collections.Counter = field(default_factory=collections.Counter)  # program name -> compiles
    traffic_s: float = 0.0
    restart_warm_up: int = 0
    restart_warm_up_s: float = 0.0
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=400))  # for exit_cause

    def start_here(self) -> None:
        self.offset = self.path.stat().st_size if self.path.exists() else 0

    def read(self) -> list[str]:
        """The whole lines written since the last read (a partial last line waits for the next)."""
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        lines = chunk[:end].decode(errors="replace").splitlines()
        self.recent.extend(lines)
        for line in lines:
            if PROCESS_START in line:
                self.in_restart_warm_up = True
            elif WARM_UP_DONE.search(line):
                self.in_restart_warm_up = False
            m = COMPILED.search(line)
            if m and self.in_restart_warm_up:
                self.restart_warm_up += 1
                self.restart_warm_up_s += float(m.group(2))
            elif m:
                self.traffic[m.group(1)] += 1
                self.traffic_s += float(m.group(2))
        return lines


def exit_cause(up_log: Path, recent: list[str], since: int) -> dict[str, Any]:
    """Why the JAX worker went: `up`'s "exited unexpectedly (…)" lines after byte `since` of up.log, and the last
    lines the old process wrote (`recent`: the worker log's latest lines, up to the new process's start)."""
    said = []
    if up_log.exists():
        with open(up_log, "rb") as f:
            f.seek(since)
            said = [x for x in f.read().decode(errors="replace").splitlines() if f"{PART} exited unexpectedly" in x]
    starts = [i for i, x in enumerate(recent) if PROCESS_START in x]
    before = recent[: starts[-1]] if starts else recent
    while before and STARTUP.search(before[-1]):  # the new process's first lines come before its PROCESS_START
        before.pop()
    return {"up_says": said, "worker_log_tail": [x[:300] for x in before if not PROGRESS.search(x)][-12:]}


@dataclass
class Probe:
    """The JAX worker of one stack. `state_dir` (where up-parts.json and logs/ are) and `metrics_url` (its /metrics)
    are each optional: what is missing reads None."""

    state_dir: Path | None
    metrics_url: str | None
    series: list[dict] = field(default_factory=list)
    restarts: list[dict] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    _pid: int | None = None
    _restarts: int | None = None
    _up_offset: int = 0
    _counter_base: dict[str, float] = field(default_factory=dict)  # counters summed over the processes before
    _counter_last: dict[str, float] = field(default_factory=dict)
    _counter_start: dict[str, float] = field(default_factory=dict)
    log: LogReader | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.state_dir is not None:
            self.log = LogReader(self.state_dir / "logs" / f"{PART}.log")

    def part(self) -> tuple[int | None, int | None]:
        """The JAX worker's pid and `up`'s restart count of it now."""
        if self.state_dir is None:
            return None, None
        try:
            facts = json.loads((self.state_dir / "up-parts.json").read_text())[PART]
        except (OSError, ValueError, KeyError):
            return None, None
        return facts.get("pid"), facts.get("restarts")

    def wait_for_warm_up(self, timeout_s: float) -> float | None:
        """Seconds until the worker's background warm-up finished (its log says so); None without a log."""
        if self.log is None:
            return None
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.log.path.exists() and WARM_UP_DONE.search(self.log.path.read_text(errors="replace")):
                return round(time.monotonic() - t0, 1)
            time.sleep(1.0)
        raise TimeoutError(f"the JAX worker's warm-up did not finish in {timeout_s:.0f} s: see {self.log.path}")

    def start(self) -> None:
        """The soak starts now: compiles, restarts and counters are counted from here."""
        self.started = time.monotonic()
        self._pid, self._restarts = self.part()
        if self.log is not None:
            self.log.start_here()
        if self.state_dir is not None and (self.state_dir / "up.log").exists():
            self._up_offset = (self.state_dir / "up.log").stat().st_size
        self._counter_start = self._counters(scrape(self.metrics_url) if self.metrics_url else {})

    def _counters(self, scraped: dict[str, float]) -> dict[str, float]:
        """The counters summed over every process since the first scrape: a counter that fell is a new process's."""
        for k in COUNTERS:
            if k not in scraped:
                continue
            if scraped[k] < self._counter_last.get(k, 0.0):
                self._counter_base[k] = self._counter_base.get(k, 0.0) + self._counter_last[k]
            self._counter_last[k] = scraped[k]
        return {k: self._counter_base.get(k, 0.0) + v for k, v in self._counter_last.items()}

    def sample(self, **context: Any) -> dict[str, Any]:
        """One point of the time series (`context`: what the soak is doing now), kept and returned."""
        with self.lock:
            pid, restarts = self.part()
            if self.log is not None:
                self.log.read()
            if (pid is not None and self._pid is not None and pid != self._pid) or (restarts or 0) > (
                self._restarts or 0
            ):
                self._on_restart(pid, restarts)
            scraped = scrape(self.metrics_url) if self.metrics_url else {}
            counters = self._counters(scraped)
            maps = scraped.get("mappings")
            if maps is None and pid is not None:
                maps = count_lines(Path(f"/proc/{pid}/maps"))
            point = {
                "t_s": round(time.monotonic() - self.started, 1),
                **context,
                "pid": pid,
                "restarts": len(self.restarts),
                "mappings": None if maps is None else int(maps),
                "rss_mb": None if pid is None or (rss := rss_mb(pid)) is None else round(rss, 1),
                "programs_held": scraped.get("programs_held"),
                **{f"metrics_{k}": round(counters[k] - self._counter_start.get(k, 0.0), 2) for k in counters},
            }
            if self.log is not None:
                point["log_compiles"] = sum(self.log.traffic.values())
                point["log_compile_s"] = round(self.log.traffic_s, 2)
                point["log_restart_warm_up_compiles"] = self.log.restart_warm_up
            self.series.append(point)
            return point

    def _on_restart(self, pid: int | None, restarts: int | None) -> None:
        assert self.state_dir is not None  # a pid is known only with a state dir
        up_log = self.state_dir / "up.log"
        event = {
            "t_s": round(time.monotonic() - self.started, 1),
            "old_pid": self._pid,
            "new_pid": pid,
            "restarts_by_up": None if restarts is None else restarts - (self._restarts or 0),
            **exit_cause(up_log, list(self.log.recent) if self.log else [], self._up_offset),
        }
        log.warning("recipe_soak: the JAX worker was restarted: %s", event)
        self.restarts.append(event)
        self._pid, self._restarts = pid, restarts
        if up_log.exists():
            self._up_offset = up_log.stat().st_size


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"first": None, "last": None, "max": None}
    return {"first": values[0], "last": values[-1], "max": max(values)}


def flatness(series: list[dict], key: str) -> dict[str, Any]:
    """First / last / max of `key` over the run, and min / max / max-min over its last half (by time): a
    worker that holds what it needs is flat there; a climb is a leak or programs piling up."""
    points = [(p["t_s"], p[key]) for p in series if p.get(key) is not None]
    if not points:
        return dict.fromkeys(("first", "last", "max", "last_half_min", "last_half_max", "last_half_spread"))
    half = points[-1][0] / 2
    late = [v for t, v in points if t >= half]
    return {
        **spread([v for _, v in points]),
        "last_half_min": min(late),
        "last_half_max": max(late),
        "last_half_spread": round(max(late) - min(late), 1),
    }


class Sampler:
    """Calls `probe.sample(**context())` every `every_s` on a thread of its own until stopped."""

    def __init__(self, probe: Probe, every_s: float, context) -> None:
        self.probe, self.every_s, self.context = probe, every_s, context
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def _run(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                self.probe.sample(**self.context())
            except Exception:  # a probe that failed once must not end the soak's series
                log.exception("recipe_soak: a sample of the JAX worker failed")

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopped.set()
        self.thread.join()


def log_errors(offsets: dict[Path, int]) -> dict[str, dict[str, Any]]:
    """ERROR / CRITICAL / Traceback lines each of the stack's logs got after its byte offset in `offsets`: per log
    (by file name) how many, and the first few distinct messages (the timestamp cut off)."""
    out = {}
    for path, since in offsets.items():
        with open(path, "rb") as f:
            f.seek(since)
            lines = f.read().decode(errors="replace").splitlines()
        bad = [x for x in lines if " ERROR " in x or " CRITICAL " in x or x.startswith("Traceback")]
        distinct = list(dict.fromkeys(re.sub(r"^\S+ \S+ ", "", x)[:300] for x in bad))
        if bad:
            out[path.name] = {"count": len(bad), "examples": distinct[:8]}
    return out


# --- the runs' data: local files in the formats the e2e cookbook tests write, with `pad` filler words before each
# prompt so that prompt lengths vary from run to run

FILLER = "the council met after the war and before the session when many members could vote"
COLOURS = ["red", "green", "blue", "black", "white", "pink", "gold", "grey"]


def filler(n: int) -> str:
    words = FILLER.split()
    return " ".join(words[i % len(words)] for i in range(n))


def _jsonl(path: Path, rows: list[dict]) -> Path:
    if not path.exists():
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def conversations(data: Path, pad: int, n: int = 48) -> Path:
    """chat_sl's conversation file: the assistant repeats two words back (test_supervised.py's pattern)."""
    pairs = [(COLOURS[i % 8], COLOURS[(i * 3 + 1) % 8]) for i in range(n)]
    return _jsonl(
        data / f"conversations-pad{pad}.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": f"{filler(pad)} say {a} {b}".strip()},
                    {"role": "assistant", "content": f"{a} {b}"},
                ]
            }
            for a, b in pairs
        ],
    )


def labelled(data: Path, pad: int) -> Path:
    """prompt_distillation's file, in the format its create_data step writes (test_recipes_text.py's sentences)."""
    sentences = ["the quick brown fox", "le renard brun", "el zorro marron", "der braune fuchs"] * 8
    labels = ["en", "fr", "es", "ot"] * 8
    return _jsonl(
        data / f"labelled-pad{pad}.jsonl",
        [
            {
                "messages": [
                    {"role": "user", "content": f"{filler(pad)} {s}".strip()},
                    {"role": "assistant", "content": label},
                ]
            }
            for s, label in zip(sentences, labels)
        ],
    )


def hh_rlhf_cache(data: Path, pad: int) -> Path:
    """A local datasets cache holding a synthetic Anthropic/hh-rlhf (the DPO CLI's `dataset=hhh`): the chosen
    answer repeats the asked word, the rejected one says another (test_dpo.py's pairs, in hh-rlhf's text format)."""
    from tests.e2e.cookbook.hf_offline import cache_dataset

    cache = data / f"hf-datasets-pad{pad}"
    if not cache.exists():

        def split(n: int) -> dict[str, list[str]]:
            asks = [f"\n\nHuman: {filler(pad)} repeat {COLOURS[i % 8]}\n\nAssistant: " for i in range(n)]
            return {
                "chosen": [a + COLOURS[i % 8] for i, a in enumerate(asks)],
                "rejected": [a + COLOURS[(i + 3) % 8] for i, a in enumerate(asks)],
            }

        cache_dataset(cache, "Anthropic/hh-rlhf", None, {"train": split(32), "test": split(8)})
    return cache
