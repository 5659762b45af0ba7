"""`tinkerflow`: a self-hosted Tinker-compatible training service on Temporal and JAX.

    tinkerflow up                 everything on this machine (Temporal dev server, workers, API)
    tinkerflow up -- CMD ARGS     ... then run CMD against it (TINKER_BASE_URL set) and stop when it exits
    tinkerflow temporal           only the Temporal dev server, with the tuned flags
    tinkerflow workflow-worker    only the workflow worker
    tinkerflow jax-worker         only a JAX worker for one base model
    tinkerflow api                only the HTTP API (the Tinker REST contract)
    tinkerflow ray                the JAX worker as Ray actors on a Ray cluster, one per host (--with-stack: all of it)
    tinkerflow make-tiny-model D  write the embedded default model (tiny Qwen3) to directory D

Every flag can also come from the environment as TINKERFLOW_<FLAG_NAME> (for example TINKERFLOW_API_KEYS).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from tinkerflow.common.logs import setup_logging
from tinkerflow.common.settings import Settings, add_common_flags

log = logging.getLogger("tinkerflow")


def _model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-model", help="HF id in the local HF cache, or a local HF directory "
                   "(default: the embedded tiny Qwen3, made on first use in <state-dir>/models)")
    p.add_argument("--served-model-name", help="name clients use for --base-model, like vLLM's flag of that name: "
                   "serve a local copy of a Hugging Face model under its HF id (e.g. Qwen/Qwen3-0.6B) so recipes "
                   "that look models up by name (tinker-cookbook's renderer and learning-rate tables) know it "
                   "(default: the HF id given to --base-model, or the directory's absolute path)")
    p.add_argument("--max-lora-adapters", type=int, help="LoRA adapter slots on the JAX worker (default 8)")
    p.add_argument("--max-lora-rank", type=int, help="largest LoRA rank a client may ask for (default 32)")
    p.add_argument("--pool", help="name of the worker pool this base model runs on (default 'default')")
    p.add_argument("--snapshot-budget-mb", type=int, help="device memory for sampler snapshots on the JAX worker; "
                   "the least recently used are evicted past it (saved weights reload on demand) "
                   "(default 0: a tenth of the device's memory)")
    p.add_argument("--metrics-port", type=int, help="serve the JAX worker's Prometheus /metrics on this port "
                   "(default 0: off; the API always serves /metrics on its own port)")
    p.add_argument("--compilation-cache-dir", metavar="DIR", help="XLA persistent compilation cache of the JAX "
                   "worker, so a restarted worker compiles nothing it compiled before; 'off' disables it "
                   "(default <state-dir>/xla-cache)")


def _api_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", help="address the API binds (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port of the API (default 8000)")
    p.add_argument("--api-key", dest="api_keys", action="append",
                   help="accepted API key, repeatable or comma-separated (env TINKERFLOW_API_KEYS); "
                        "none means any key is accepted, with a warning")
    p.add_argument("--api-keys-file", help="file of accepted API keys, one per line (env TINKERFLOW_API_KEYS_FILE)")
    p.add_argument("--session-timeout-s", type=float, help="end a session after this long without a heartbeat "
                   "(default 120)")
    p.add_argument("--max-request-bytes", type=int, help="refuse request bodies larger than this with HTTP 413, "
                   "on the wire and after zstd decompression (default 256 MiB)")
    p.add_argument("--max-queued-sample-tokens", type=int, help="answer asample with HTTP 429 while this many tokens "
                   "of sampling work (samples x (prompt + max_tokens)) are queued for one base model (default 1Mi)")
    p.add_argument("--max-sample-body-bytes", type=int, help="HTTP 413 for an asample body larger than this, "
                   "before it is read (default 16 MiB)")
    p.add_argument("--max-control-body-bytes", type=int, help="HTTP 413 for a body larger than this on every route "
                   "but forward_backward and asample, before it is read (default 1 MiB)")
    p.add_argument("--max-samples-per-request", type=int, help="largest num_samples one asample may ask for "
                   "(HTTP 400 beyond; default 128)")
    p.add_argument("--max-sample-tokens", type=int, help="largest max_tokens one asample may ask for (HTTP 400 "
                   "beyond; default 8192)")
    p.add_argument("--max-datums-per-request", type=int, help="most datums in one forward_backward (beyond, its "
                   "future fails with a user error; default 4096)")
    p.add_argument("--auto-snapshot-every", type=int, help="save an automatic snapshot of each run every N optim "
                   "steps, so a dead JAX worker's runs are restored exactly elsewhere (default 10; 0: off, a dead "
                   "worker's runs then fail)")
    p.add_argument("--url-signing-key", help="secret that signs checkpoint download URLs; API replicas must share it "
                   "(env TINKERFLOW_URL_SIGNING_KEY; default: a random key kept in <state-dir>/url-signing.key)")
    p.add_argument("--metrics-access", choices=("key", "public", "off"), help="who may read the API's /metrics: "
                   "any accepted API key (X-API-Key or Authorization: Bearer; the default), anyone (public), or "
                   "nobody (off); env TINKERFLOW_METRICS_ACCESS")
    p.add_argument("--api-docs", action="store_true", default=None, help="serve /openapi.json, /docs and /redoc "
                   "to anyone (default off; env TINKERFLOW_API_DOCS=1)")
    p.add_argument("--max-queued-samples", type=int, help="answer asample with HTTP 429 (the SDK backs off and "
                   "retries) while this many samples are queued for one base model (default 1024)")


def _temporal_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temporal-port", type=int, default=7233, help="frontend port of the dev server (default 7233)")
    p.add_argument("--ui-port", type=int, default=8233, help="port of the Temporal Web UI (default 8233)")
    p.add_argument("--headless", action="store_true", help="do not serve the Temporal Web UI")


def _mesh_flags(g) -> None:
    g.add_argument("--mesh-fsdp", type=int, metavar="N", help="devices on the mesh's fsdp axis, over all processes "
                   "(default 0: every device not on tp)")
    g.add_argument("--mesh-tp", type=int, metavar="N", help="devices on the mesh's tp (tensor-parallel) axis "
                   "(default 1)")
    g.add_argument("--mesh-ep", type=int, metavar="N", help="devices on the mesh's ep (expert-parallel) axis, for "
                   "mixture-of-experts models; num_experts must divide by it (default 1: no ep axis)")


def _ray_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray placement (each also read from TINKERFLOW_RAY_<NAME>)")
    g.add_argument("--ray-address", help="Ray cluster to join, e.g. ray://head:10001 or head:6379 (default: the "
                   "cluster of the Ray job this runs in, or $RAY_ADDRESS, or a local `ray start`)")
    g.add_argument("--hosts", dest="ray_hosts", type=int, metavar="N", help="hosts, one JAX process and one "
                   "placement-group bundle each; above 1 they form one jax.distributed group (default 1)")
    g.add_argument("--cpus-per-host", dest="ray_cpus_per_host", type=float, metavar="N",
                   help="CPUs in each host's bundle (default 1)")
    g.add_argument("--gpus-per-host", dest="ray_gpus_per_host", type=float, metavar="N",
                   help="GPUs in each host's bundle (default 0)")
    g.add_argument("--tpus-per-host", dest="ray_tpus_per_host", type=float, metavar="N",
                   help="TPU chips in each host's bundle, e.g. 4 on a v6e 4x4 slice's hosts (default 0)")
    g.add_argument("--strategy", dest="ray_strategy", choices=["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"],
                   help="placement strategy of the bundles (default STRICT_SPREAD: one bundle per node)")
    g.add_argument("--max-restarts", dest="ray_max_restarts", type=int, metavar="N",
                   help="times Ray may restart each actor; a fault restarts the whole group (default 10; -1: no "
                   "limit)")
    _mesh_flags(g)
    p.add_argument("--with-stack", action="store_true", help="also run Temporal (a dev server unless "
                   "--temporal-address), the workflow worker and the API on this (the driver's) node")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinkerflow", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run the whole stack on this machine",
                        description="Start a Temporal dev server (unless --temporal-address is given), the workflow "
                        "worker, one JAX worker and the API; show progress while each gets ready; restart a part that "
                        "exits unexpectedly (with backoff; runs on a restarted JAX worker restore themselves); stop "
                        "them all on Ctrl-C, SIGTERM or when one part crash-loops. A second `up` on the same "
                        "--state-dir finds its history again. "
                        "With `-- CMD ARGS`, run CMD once everything is ready, then stop and exit with its status.")
    _model_flags(up)
    _api_flags(up)
    _temporal_flags(up)
    sv = up.add_argument_group("supervision (each also read from TINKERFLOW_<NAME>)")
    sv.add_argument("--restart-backoff-s", type=float, metavar="S", help="wait this long before restarting a part "
                    "that exited unexpectedly, doubled for each further restart in the window (default 1)")
    sv.add_argument("--restart-backoff-max-s", type=float, metavar="S", help="longest wait before a restart "
                    "(default 30)")
    sv.add_argument("--crash-loop-restarts", type=int, metavar="N", help="stop everything when one part needs more "
                    "than N restarts within --crash-loop-window-s (default 5)")
    sv.add_argument("--crash-loop-window-s", type=float, metavar="S", help="the crash-loop window (default 300)")
    sv.add_argument("--up-metrics-port", type=int, metavar="PORT", help="serve `up`'s own Prometheus /metrics "
                    "(tinkerflow_up_restarts_total by part) on this port (default 0: off)")
    up.add_argument("then", nargs=argparse.REMAINDER, help="optional: -- CMD ARGS to run against the stack")

    t = sub.add_parser("temporal", help="run only the Temporal dev server (tuned flags, SQLite in the state dir)")
    _temporal_flags(t)

    sub.add_parser("workflow-worker", help="run only the workflow worker (stateless; run several if you like)")

    jw = sub.add_parser("jax-worker", help="run only a JAX worker serving one base model")
    _model_flags(jw)
    jw.add_argument("--worker-id", help="stable id of this worker (default: <hostname>-<pool>-0)")
    mh = jw.add_argument_group("multi-host (one process per host; each also read from TINKERFLOW_<NAME>)")
    mh.add_argument("--coordinator-address", metavar="HOST:PORT", help="jax.distributed coordinator: process 0's "
                    "host and a free port (env TINKERFLOW_COORDINATOR_ADDRESS)")
    mh.add_argument("--num-processes", type=int, metavar="N", help="processes (hosts) in the worker; above 1 they "
                    "join jax.distributed, process 0 takes activities and drives the others (default 1)")
    mh.add_argument("--process-id", type=int, metavar="I", help="this process's index in [0, N) (default 0)")
    _mesh_flags(mh)

    api = sub.add_parser("api", help="run only the HTTP API under uvicorn")
    _api_flags(api)

    ray = sub.add_parser("ray", help="run the JAX worker as Ray actors, one per host (needs the `ray` extra)",
                         description="Join a Ray cluster (as a Ray job: `ray job submit -- tinkerflow ray ...`, or "
                         "with --ray-address), place one bundle per host in a placement group and start one "
                         "JAX-worker actor in each, joined into one jax.distributed group (process 0 on bundle 0 "
                         "takes the work). An actor that dies is restarted by Ray with the rest of its group; the "
                         "runs it held are restored from their snapshots. With --with-stack the driver's node also "
                         "runs Temporal, the workflow worker and the API. SIGTERM (`ray job stop`) stops every actor "
                         "and removes the placement group. For several nodes give --store-url and --checkpoint-root "
                         "every host can reach (gs://...), and --host 0.0.0.0 for the API.")
    _model_flags(ray)
    _api_flags(ray)
    _temporal_flags(ray)
    _ray_flags(ray)

    tiny = sub.add_parser("make-tiny-model", help="write the embedded default model (deterministic tiny Qwen3)")
    tiny.add_argument("directory", help="where to write config.json, model.safetensors and the tokenizer")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    tiny.add_argument("--moe", action="store_true", help="write the tiny Qwen3-MoE (8 routed experts, top-2) instead; "
                      "serve it with --base-model D")

    for p in (up, t, sub.choices["workflow-worker"], jw, api, ray):
        add_common_flags(p)
        p.add_argument("--ready-file", help=argparse.SUPPRESS)  # touched when ready; used by `up`
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = Settings().with_args(args)
    setup_logging(settings.log_level, args.command, settings.log_format)
    if args.command == "make-tiny-model":
        from tinkerflow.workers.engine.tiny_model import make_tiny_model

        print(make_tiny_model(args.directory, seed=args.seed, progress=True, moe=args.moe))
        return 0
    if args.command == "up":
        from tinkerflow.cli.up import run_up

        then = args.then[1:] if args.then[:1] == ["--"] else args.then
        return run_up(settings, args, then)
    if args.command == "temporal":
        from tinkerflow.cli import temporal_server

        settings.state_dir.mkdir(parents=True, exist_ok=True)
        cmd = temporal_server.command(settings.state_dir / "temporal.db", port=args.temporal_port,
                                      ui_port=args.ui_port, namespace=settings.temporal_namespace,
                                      headless=args.headless)
        log.info("starting %s", " ".join(cmd))
        os.execv(cmd[0], cmd)
    if args.command == "ray":
        from tinkerflow.cli.ray_launch import run_ray

        return run_ray(settings, args)
    if args.command == "api":
        return _run_api(settings, args.ready_file)
    if args.command == "workflow-worker":
        from tinkerflow.workers import workflow_worker

        return _run_async(workflow_worker.serve, settings, args.ready_file)
    if args.command == "jax-worker":
        from tinkerflow.workers import jax_worker

        return _run_async(jax_worker.serve, settings, args.ready_file, worker_id=args.worker_id)
    return 2


def _run_async(serve, settings: Settings, ready_file: str | None, **kwargs) -> int:
    async def go() -> None:
        ready, stop = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        async def mark_ready() -> None:
            await ready.wait()
            if ready_file:
                Path(ready_file).touch()

        marker = asyncio.create_task(mark_ready())
        await serve(settings, ready=ready, stop=stop, **kwargs)
        marker.cancel()

    asyncio.run(go())
    return 0


def _run_api(settings: Settings, ready_file: str | None) -> int:
    import uvicorn

    from tinkerflow.api.app import create_app

    app = create_app(settings)  # readiness: /api/v1/healthz answers once the app's start-up has finished
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                access_log=settings.log_level.upper() == "DEBUG")
    return 0


if __name__ == "__main__":
    sys.exit(main())
