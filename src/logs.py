"""structlog set-up, done once per process at its edge (CLI, worker main)."""

from __future__ import annotations

import logging
import sys

import structlog

_configured = False


class StderrLogger:
    """Writes each rendered line to the *current* ``sys.stderr``, and never raises.

    structlog's PrintLogger binds the stream object at configuration time; a
    stream that is later replaced and closed (pytest's capture, interpreter
    teardown) would then raise inside background threads, and a thread that
    dies while reporting a worker's death would strand the requests it was
    about to fail.
    """

    def msg(self, message: str) -> None:
        try:
            stream = sys.stderr
            stream.write(message + "\n")  # one write: print's two let another thread's line in between
            stream.flush()
        except (OSError, ValueError):  # closed or replaced stream: drop the line
            pass

    log = debug = info = warn = warning = error = critical = exception = fatal = failure = msg


def _logger_factory(*_args: object) -> StderrLogger:
    return StderrLogger()


def configure(*, json: bool | None = None, level: str = "info") -> None:
    """Configure structlog once: lines on stderr, JSON when stderr is not a terminal."""
    global _configured
    if _configured:
        return
    stream = sys.stderr
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
        logger_factory=_logger_factory,
        cache_logger_on_first_use=True,
    )
    _configured = True
