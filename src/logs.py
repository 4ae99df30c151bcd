"""structlog set-up, done once per process at its edge (CLI, worker main)."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

_configured = False


def configure(*, json: bool | None = None, level: str = "info", stream: TextIO | None = None) -> None:
    """Configure structlog once: JSON lines when `stream` is not a terminal, else console."""
    global _configured
    if _configured:
        return
    stream = stream or sys.stderr
    if json is None:
        json = not stream.isatty()
    renderer = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=True,
    )
    _configured = True
