"""The supervisor's wake-up pipe and what the signals it carries ask of the daemon.

Signal handlers only enqueue: Python writes each signal's number to the pipe (``signal.set_wakeup_fd``),
the supervisor's loop reads them here, in order (``Requests.read``), and each is recorded for the end to
honour (``kvcached.daemon.requests`` lists them): a stop that releases the memory (``stop``), a stop that
keeps it (``keep``), a restart (``restart``, which keeps it too). A restart is accepted only when the
supervisor's ``why_not_restart`` has nothing against it; a refused one is written where ``kvcached
restart`` reads it (``kvcached.daemon.handover``), and the daemon serves on. SIGUSR1 logs each rank;
SIGCHLD only wakes the loop (it reaps every turn).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path

from kvcached import logs
from kvcached.daemon import faults, handover
from kvcached.daemon.requests import KEEP_SIGNAL, LOG_SIGNAL, RESTART_SIGNAL, STOP_SIGNALS
from kvcached.daemon.requests import name as signal_name


class Requests:
    """The wake-up pipe (``fileno`` is its read end) and what the operator asked so far."""

    def __init__(self, log: logs.Logger, *, refusals: Path, why_not_restart: Callable[[], str]) -> None:
        self.log = log
        self.refusals = refusals
        self.why_not_restart = why_not_restart
        self.read_fd, self.write_fd = -1, -1
        self.stop = False  # a stop that releases the memory
        self.keep = False  # ending keeps the memory for the next start
        #: The daemon ends to execute itself again (``kvcached restart``): its caller does that.
        self.restart = False

    def install(self) -> None:
        """Make the pipe and route every signal the daemon takes to it."""
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        handled = (*STOP_SIGNALS, KEEP_SIGNAL, RESTART_SIGNAL, LOG_SIGNAL)
        for signum in (*handled, signal.SIGCHLD):
            signal.signal(signum, lambda *_: None)  # the wake-up fd carries the signal number
        handover.unblock_requests()  # held by the image before, if a restart executed this one

    def fileno(self) -> int:
        return self.read_fd

    def read(self, log_ranks: Callable[[str], None]) -> bool:
        """Take what the pipe holds; True when a signal asks the daemon to end now. ``log_ranks`` logs each
        rank's state (SIGUSR1), given the signal's name."""
        try:
            data = os.read(self.read_fd, 512)
        except BlockingIOError:
            return False
        for signum in data:
            if signum in STOP_SIGNALS:
                self.stop = True
                self.log.info("stopping", signal=signal_name(signum))
                return True
            if signum == KEEP_SIGNAL:
                self.keep = True
                self.log.info("stopping, keeping the memory for the next start", signal=signal_name(signum))
                return True
            if signum == RESTART_SIGNAL and self._accept_restart():
                return True
            if signum == LOG_SIGNAL:
                log_ranks(signal_name(signum))
        return False

    def _accept_restart(self) -> bool:
        """Whether to end now for ``kvcached restart``; when not, say why where the CLI reads it."""
        why = self.why_not_restart()
        if why:
            self.log.error("restart refused; serving on", reason=why)
            handover.record_refusal(self.refusals, why)
            return False
        handover.block_requests()  # a stop or restart sent from now on waits for the next image
        self.keep = self.restart = True
        faults.fault("restart-accepted")
        self.log.info("restarting, keeping the memory for the next image", signal="SIGUSR2")
        return True
