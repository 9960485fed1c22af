"""Logging, configured once at the daemon's entry point (never by the runner client).

Shared processors with ``merge_contextvars`` first; a console renderer on a TTY, one JSON object per
line otherwise (journald, files). Workers bind ``rank`` with ``bind_contextvars``; the supervisor binds
``instance``. Everything goes to stderr.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

LEVELS = ("debug", "info", "warning", "error")
_configured = False


def configure(level: str = "info", *, json: bool | None = None) -> None:
    """Configure structlog for this process. Idempotent; ``json=None`` picks JSON unless stderr is a TTY."""
    global _configured
    if json is None:
        json = not sys.stderr.isatty()
    renderer: Any = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=False),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def get(name: str = "kvcached") -> Any:
    """A structlog logger; configures defaults first if the entry point has not."""
    if not _configured:
        configure()
    return structlog.get_logger(name)
