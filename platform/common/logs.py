"""Logging set-up shared by every process: levels, one format, rich console when attached to a terminal."""

from __future__ import annotations

import json
import logging
import sys


class JsonFormatter(logging.Formatter):
    """One JSON object per line, for log pipelines (Cloud Logging picks up `severity` and `message`)."""

    def __init__(self, process: str):
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "severity": record.levelname,
            "process": self.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str = "INFO", process: str = "", fmt: str = "text") -> None:
    prefix = f"[{process}] " if process else ""
    if fmt == "json":
        handler = logging.StreamHandler()
        handler.setFormatter(JsonFormatter(process))
    elif sys.stderr.isatty():
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
