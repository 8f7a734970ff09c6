"""structlog set-up: JSON lines for journald, a console renderer on a TTY.

Everything logs through structlog with context bound per session (``session``, ``app``,
``pid``), so one ``journalctl -u rrtod -o cat | jq 'select(.session=="...")'`` follows a session.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog


def setup(fmt: str = "auto", level: str = "info", stream: TextIO | None = None) -> None:
    """Daemons log to stdout (journald); the shim passes stderr so the app's stdout stays clean."""
    stream = stream or sys.stdout
    use_console = fmt == "console" or (fmt == "auto" and stream.isatty())
    renderer = structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
