"""structlog setup shared by every Seer process.

Each process writes JSON lines (one event per line, snake_case past-tense event names
with ids as fields) to its own file in the run dir, and readable lines to stderr: every
event when stderr is a terminal or there is no file, else warnings and errors only (a
background daemon's stderr is ``daemon.out``, which would repeat the whole file; rendering
every chunk's events twice cost the control plane about a tenth of its CPU).
Call ``configure_logging`` once at process start; modules use ``structlog.get_logger()``.
Log per chunk, never per token (each event is a JSON line written to a file).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
           "critical": logging.CRITICAL}


def _console_level(has_file: bool, level: str) -> int:
    """Every event on a terminal or without a file; else warnings and errors (the file has all)."""
    if not has_file or sys.stderr.isatty():
        return _LEVELS[level]
    return logging.WARNING


class _Tee:
    """Render each event twice: JSON to the file, key=value to the console."""

    def __init__(self, file: TextIO | None, console: TextIO | None, console_level: int = logging.DEBUG) -> None:
        self._file = file
        self._console = console
        self._console_level = console_level
        self._json = structlog.processors.JSONRenderer()
        self._pretty = structlog.dev.ConsoleRenderer(colors=False)

    def __call__(self, logger: object, name: str, event_dict: dict) -> str:
        if self._file is not None:
            self._file.write(self._json(logger, name, dict(event_dict)) + "\n")
            self._file.flush()
        if self._console is not None and _LEVELS.get(event_dict.get("level", ""), logging.INFO) >= self._console_level:
            return self._pretty(logger, name, event_dict)
        raise structlog.DropEvent


def configure_logging(process: str, log_file: Path | None, level: str = "info", console: bool = True,
                      cache: bool = True) -> None:
    """``cache=False`` is for a control plane run inside another program (a test): cached
    loggers would keep this configuration after ``structlog.reset_defaults()``."""
    file = open(log_file, "a", buffering=1) if log_file is not None else None  # noqa: SIM115 - lives as long as the process
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            lambda _l, _n, ev: {**ev, "process": process},
            _Tee(file, sys.stderr if console else None, _console_level(file is not None, level)),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=cache,
    )
