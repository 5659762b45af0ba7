"""The tables of docs/benchmarks.md beyond the main one, written by benchmarks/report.py from the figures' JSON
lines: the prefix cache's workloads, where a trivial op's time goes in the control plane, and adapter paging; and
how a figure is written in any of them."""

from __future__ import annotations


def fmt(value: object) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


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
        through = (fmt(sdk["tinkerflow"]), fmt(sdk.get("ratio")), fmt(sdk.get("hit_tokens"))) if sdk else ("—",) * 3
        served = engine.get("served_tokens", engine["hit_tokens"])
        rows.append(
            f"| {label} | {fmt(engine['cache_off'])} | {fmt(engine['cache_on'])} | {fmt(engine['speedup'])} | "
            f"{fmt(served)} | {' | '.join(through)} |"
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
            f"| {x['runs']:,} | {fmt(x.get('creates_per_s'))} | {x.get('rounds')} | {x.get('page_ins_per_step')} / "
            f"{x.get('engine_page_ins_per_step')} | {fmt(x.get('page_store_host_mb'))} / "
            f"{fmt(x.get('engine_page_store_host_mb'))} | {fmt(x.get('worker_rss_mb'))} | "
            f"{fmt(x.get('engine_process_peak_rss_mb'))} |"
            for x in rows
        ],
    ]
