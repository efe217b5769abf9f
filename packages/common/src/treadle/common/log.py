"""Structured logging for every treadle process.

``setup_logging()`` once in an entry point; ``get_logger(__name__)`` everywhere. Records carry
``extra={"fields": {...}}`` key/values, printed as ``key=value`` pairs in text mode or merged
into one JSON object per line when ``TREADLE_LOG_JSON=1`` (log shippers want that). Level and
format come from the env knobs in ``treadle.common.env``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from treadle.common import env

_CONFIGURED = False


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname[0]} {record.name}: {record.getMessage()}"
        fields = getattr(record, "fields", None)
        if fields:
            base += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        if record.exc_info:
            base += "\n" + self.formatException(record.exc_info)
        return base


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": round(record.created, 6), "level": record.levelname, "logger": record.name,
            "msg": record.getMessage(),
        }
        obj.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, default=str)


def setup_logging(level: str | None = None, json_lines: bool | None = None, stream: Any = None) -> None:
    """Configure the ``treadle`` logger tree once per process (later calls reconfigure it)."""
    global _CONFIGURED
    level = level or env.get("TREADLE_LOG_LEVEL")
    json_lines = env.get("TREADLE_LOG_JSON") if json_lines is None else json_lines
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_JsonFormatter() if json_lines else _TextFormatter())
    root = logging.getLogger("treadle")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    _CONFIGURED = True


def get_logger(name: str) -> logging.Logger:
    """A logger under the ``treadle`` tree (configured with defaults on first use)."""
    if not _CONFIGURED:
        setup_logging()
    return logging.getLogger(name if name.startswith("treadle") else f"treadle.{name}")


class Timer:
    """Context manager measuring wall time in seconds: ``with Timer() as t: ...; t.seconds``."""

    __slots__ = ("start", "seconds")

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
