"""Logging set-up shared by every process: levels, one format, rich console when attached to a terminal."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str = "INFO", process: str = "") -> None:
    prefix = f"[{process}] " if process else ""
    if sys.stderr.isatty():
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(show_path=False, rich_tracebacks=True)
        handler.setFormatter(logging.Formatter(prefix + "%(name)s: %(message)s"))
    else:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "jax._src", "absl", "urllib3", "fsspec"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
