"""Logging, configured once at the daemon's entry point (never by the runner client).

Shared processors with ``merge_contextvars`` first; a console renderer on a TTY, one JSON object per line otherwise
(journald, files), all to stderr. Workers bind ``rank`` with ``bind_contextvars``; the supervisor binds ``instance``
(and ``generation``). Modules take their logger with ``logs.get(name)`` where they use it; only ``configure`` (called
by ``kvcached start``) decides where it goes. A line that cannot be written (stderr closed, a pipe whose reader left) is
dropped: losing a line must never stop the daemon that serves the cache.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import IO, Any

import structlog
from structlog.typing import FilteringBoundLogger

#: What a kvcached module logs through.
Logger = FilteringBoundLogger
LEVELS = ("debug", "info", "warning", "error")


class _Tolerant:
    """A text stream whose write and flush errors are swallowed (the line is lost, the process lives)."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (OSError, ValueError):
            return 0

    def flush(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def configure(level: str = "info", *, json: bool | None = None) -> None:
    """Configure structlog for this process; ``json=None`` picks JSON unless stderr is a TTY."""
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
        # One write per record, its newline included: another writer of the same stderr (Mooncake's C++ logging
        # in the keeper) cannot land inside a JSON line.
        logger_factory=structlog.WriteLoggerFactory(file=_Tolerant(sys.stderr)),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )


def get(name: str) -> Logger:
    """The logger of ``name`` (typed)."""
    logger: Logger = structlog.get_logger(name)
    return logger
