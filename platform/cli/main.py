"""`tinkerflow`: a self-hosted Tinker-compatible training service on Temporal and JAX.

    tinkerflow up                 everything on this machine (Temporal dev server, workers, API)
    tinkerflow up -- CMD ARGS     ... then run CMD against it (TINKER_BASE_URL set) and stop when it exits
    tinkerflow temporal           only the Temporal dev server, with the tuned flags
    tinkerflow workflow-worker    only the workflow worker
    tinkerflow jax-worker         only a JAX worker for one base model
    tinkerflow api                only the HTTP API (the Tinker REST contract)
    tinkerflow ray                the JAX worker as Ray actors on a Ray cluster, one per host (--with-stack: all of it)
    tinkerflow make-tiny-model D  write the embedded default model (a tiny checkpoint) to directory D

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

from tinkerflow.cli import usage
from tinkerflow.cli.flags import add_settings_flags, settings_from
from tinkerflow.common.logs import setup_logging
from tinkerflow.common.quotas import QuotaFileError
from tinkerflow.common.quotas import load as load_quotas
from tinkerflow.common.settings import (
    API,
    COMMON,
    DEV_TEMPORAL,
    JAX_WORKER,
    MESH,
    MODEL,
    RAY,
    SUPERVISION,
    Settings,
    SettingsError,
)

log = logging.getLogger("tinkerflow")
API_COMMANDS = ("api", "up", "ray")  # the commands that run the HTTP API (ray: with --with-stack)


# The Settings groups each sub-command shows, in --help order (the flags themselves come from Settings: flags.py).
COMMAND_GROUPS: dict[str, tuple[str, ...]] = {
    "up": (MODEL, API, DEV_TEMPORAL, SUPERVISION, COMMON),
    "temporal": (DEV_TEMPORAL, COMMON),
    "workflow-worker": (COMMON,),
    "jax-worker": (MODEL, JAX_WORKER, MESH, COMMON),
    "api": (API, COMMON),
    "ray": (MODEL, API, DEV_TEMPORAL, RAY, MESH, COMMON),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tinkerflow", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser(
        "up",
        help="run the whole stack on this machine",
        description="Start a Temporal dev server (unless --temporal-address is given), the workflow "
        "worker, one JAX worker and the API; show progress while each gets ready; restart a part that "
        "exits unexpectedly (with backoff; runs on a restarted JAX worker restore themselves); stop "
        "them all on Ctrl-C, SIGTERM or when one part crash-loops. A second `up` on the same "
        "--state-dir finds its history again. "
        "With `-- CMD ARGS`, run CMD once everything is ready (with TINKER_BASE_URL and TINKER_API_KEY set), "
        "then stop and exit with its status; with --keep-up, stay up after CMD until Ctrl-C. "
        "It prints where the API, the console and the Temporal UI are, and what an API key means here "
        "(no keys configured: any key, one tenant; with --api-key: each key its own tenant).",
    )
    up.add_argument(
        "--keep-up",
        action="store_true",
        help="with -- CMD: keep the stack up after CMD exits (to look at its runs in the console) until Ctrl-C",
    )

    sub.add_parser("temporal", help="run only the Temporal dev server (tuned flags, SQLite in the state dir)")

    sub.add_parser("workflow-worker", help="run only the workflow worker (stateless; run several if you like)")

    sub.add_parser("jax-worker", help="run only a JAX worker serving one base model")

    sub.add_parser("api", help="run only the HTTP API under uvicorn")

    ray = sub.add_parser(
        "ray",
        help="run the JAX worker as Ray actors, one per host (needs the `ray` extra)",
        description="Join a Ray cluster (as a Ray job: `ray job submit -- tinkerflow ray ...`, or "
        "with --ray-address), place one bundle per host in a placement group and start one "
        "JAX-worker actor in each, joined into one jax.distributed group (process 0 on bundle 0 "
        "takes the work). An actor that dies is restarted by Ray with the rest of its group; the "
        "runs it held are restored from their snapshots. With --with-stack the driver's node also "
        "runs Temporal, the workflow worker and the API. SIGTERM (`ray job stop`) stops every actor "
        "and removes the placement group. For several nodes give --store-url and --checkpoint-root "
        "every host can reach (gs://...), and --host 0.0.0.0 for the API.",
    )
    ray.add_argument(
        "--with-stack",
        action="store_true",
        help="also run Temporal (a dev server unless "
        "--temporal-address), the workflow worker and the API on this (the driver's) node",
    )

    tiny = sub.add_parser("make-tiny-model", help="write the embedded default model (a deterministic tiny checkpoint)")
    tiny.add_argument("directory", help="where to write config.json, model.safetensors and the tokenizer")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    tiny.add_argument(
        "--family",
        help="another model family's tiny checkpoint (a folder of the engine's model/families/ that has one) instead "
        "of the embedded default's; serve it with --base-model D",
    )
    tiny.add_argument(
        "--vision",
        action="store_true",
        help="the family's vision-language checkpoint (a vision tower, preprocessor_config.json, the vision tokens): "
        "--family qwen3_5 or qwen3_vl",
    )

    usage.add_parser(sub)  # a client of a running API: no settings flags of its own

    for name, groups in COMMAND_GROUPS.items():
        p = sub.choices[name]
        add_settings_flags(p, groups)
        p.add_argument("--ready-file", help=argparse.SUPPRESS)  # touched when ready; used by `up`
    up.add_argument("then", nargs=argparse.REMAINDER, help="optional: -- CMD ARGS to run against the stack")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from(args)
        if args.command in API_COMMANDS:  # refused before anything starts, not by a part `up` restarts
            settings.check_api()
            if settings.quota_file:
                load_quotas(settings.quota_file).by_key_id(str, settings.accepted_api_keys())
    except (SettingsError, QuotaFileError) as e:
        parser.error(str(e))
    setup_logging(settings.log_level, args.command, settings.log_format)
    if args.command == "make-tiny-model":
        from tinkerflow.workers.engine.model.tiny_model import make_tiny_model

        family = {"family": args.family} if args.family else {}
        try:
            print(make_tiny_model(args.directory, seed=args.seed, progress=True, vision=args.vision, **family))
        except ValueError as e:
            parser.error(str(e))
        return 0
    if args.command == "usage":
        return usage.run_usage(args)
    if args.command == "up":
        from tinkerflow.cli.up import run_up
        from tinkerflow.common.errors import UnknownModelError
        from tinkerflow.workers.base_model import check_base_model

        try:  # before any part starts: a model no family serves fails here in one line, not in the JAX worker's log
            check_base_model(settings)
        except UnknownModelError as e:
            parser.exit(2, f"tinkerflow up: error: {e}\n")

        then = args.then[1:] if args.then[:1] == ["--"] else args.then
        return run_up(settings, args, then)
    if args.command == "temporal":
        from tinkerflow.cli import temporal_server

        settings.state_dir.mkdir(parents=True, exist_ok=True)
        cmd = temporal_server.command(
            settings.state_dir / "temporal.db",
            port=settings.temporal_port,
            ui_port=settings.ui_port,
            namespace=settings.temporal_namespace,
            headless=settings.headless,
        )
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

        jax_worker.keep_torch_out()  # a process of its own: seconds off every start (see the function)
        return _run_async(jax_worker.serve, settings, args.ready_file, worker_id=settings.worker_id or None)
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

    try:
        app = create_app(settings)  # readiness: /api/v1/healthz answers once the app's start-up has finished
    except (SettingsError, QuotaFileError) as e:
        log.error("%s", e)
        return 2
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=settings.log_level.upper() == "DEBUG",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
