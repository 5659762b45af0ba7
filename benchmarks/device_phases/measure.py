"""What every phase measures with: the JSON line a figure is, the time budget, a jitted call's wall times and the
profiler's top kernels."""

from __future__ import annotations

import json
import tempfile
import time

from benchmarks.device_phases import provenance


def emit(out: list | None = None, **figure) -> None:
    """Print one figure as a JSON line, stamped with where and when it was measured (provenance.stamp)."""
    line = json.dumps({**figure, **provenance.stamp()}, default=str)
    print(line, flush=True)
    if out is not None:
        out.append(line)


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def timed(fn, repeats: int) -> list[float]:
    import jax

    jax.block_until_ready(fn())  # compile and warm
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t0)
    return out


def profile_top(label: str, fn, top: int = 15) -> None:
    """Run fn once under jax's profiler and emit where the device's time went: the `top` kernels (or host ops on
    CPU) by total time, with counts and the total."""
    import collections
    import glob
    import gzip

    import jax

    directory = tempfile.mkdtemp(prefix="device-check-profile-")
    with jax.profiler.trace(directory, create_perfetto_trace=True):
        jax.block_until_ready(fn())
    files = glob.glob(f"{directory}/**/*perfetto_trace.json.gz", recursive=True)
    if not files:
        emit(phase="profile", label=label, error="no perfetto trace written")
        return
    with gzip.open(files[-1]) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = [pid for pid, name in procs.items() if "device" in name.lower() or "gpu" in name.lower()]
    keep = set(device) or set(procs)
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in keep:
            total[e["name"]] += e.get("dur", 0)
            count[e["name"]] += 1
    emit(
        phase="profile",
        label=label,
        where="device" if device else "host",
        total_ms=round(sum(total.values()) / 1e3, 2),
        events=sum(count.values()),
        top=[[name[:90], round(us / 1e3, 3), count[name]] for name, us in total.most_common(top)],
    )
