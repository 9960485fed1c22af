"""Fatal errors of the daemon and the exit status each one carries.

The exit statuses are a public interface, each said in ``EXIT_STATUS_HELP`` (``start --help``): the systemd unit lists
the configuration ones in ``RestartPreventExitStatus=`` so that a bad config is not restarted in a loop.
"""

from __future__ import annotations

EXIT_STATUS_HELP = (
    "Exit statuses of `start`: 0 stopped cleanly, 1 a rank failed at run time, 2 usage error (unknown option),\n"
    "3 instance already running, 4 configuration error (a value, a flag, a variable or a file key),\n"
    "5 host resources (not enough /dev/shm, names or paths taken by someone else).\n"
    "Other commands: 0 success, 1 failure (status: not ready; doctor: a check failed, a bad value among them), "
    "2 usage, 4 configuration (doctor: only an --instance it cannot check)."
)

EXIT_OK = 0  # stopped cleanly (SIGTERM / SIGINT / ``kvcached stop``)
EXIT_FAILURE = 1  # a rank failed while running (worker died or hung): restarting may help
EXIT_USAGE = 2  # command-line usage error (click)
EXIT_ALREADY_RUNNING = 3
EXIT_CONFIG = 4  # including a spec for which the runner owns the cache
EXIT_RESOURCES = 5  # not enough /dev/shm, or our object names taken by someone else


class Fatal(Exception):
    """Stop the daemon with ``exit_status`` after cleaning up; ``reason`` is logged and printed."""

    def __init__(self, reason: str, exit_status: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_status = exit_status


class WorkerFailure(Fatal):
    """A rank worker cannot go on: ``reason`` goes to the supervisor (``Failed``), which ends the daemon with
    ``exit_status``."""
