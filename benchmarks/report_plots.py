"""The plots of docs/benchmarks.md (PNG beside it), drawn by benchmarks/report.py from the figures' JSON lines: the
two sweeps, and seconds and memory against tokens for long sequences."""

from __future__ import annotations

from pathlib import Path


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
