"""The supervisor's wake-up pipe and what the signals it carries ask of the daemon.

Python writes each signal's number to the pipe (``signal.set_wakeup_fd``); the supervisor's loop reads them here, in
order (``Requests.read``), each recorded for the end to honour (``stop``, ``keep``, ``restart``:
``kvcached.daemon.requests`` says what each asks). Each decision on a restart, refused (the daemon serves on) or
accepted, is written where ``kvcached restart`` reads it (``handover.record_outcome``: one whose signal comes later
waits for the next image's decision on it). SIGCHLD only wakes the loop (it reaps every turn).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvcached import logs
from kvcached.daemon import faults, handover
from kvcached.daemon.requests import KEEP_SIGNAL, LOG_SIGNAL, RESTART_SIGNAL, STOP_SIGNALS
from kvcached.daemon.requests import name as signal_name

#: Signal numbers the loop takes from the pipe a turn.
READ_BYTES = 512
#: Held pending from an accepted restart until the next image has its handlers (SIGUSR1's default would end it).
HELD = handover.REQUEST_SIGNALS | {LOG_SIGNAL}
#: The ranks are logged at most this often, however many SIGUSR1 come.
LOG_EVERY_S = 1.0


class Requests:
    """The wake-up pipe (``fileno`` is its read end) and what the operator asked so far."""

    def __init__(
        self, log: logs.Logger, *, refusals: Path, why_not_restart: Callable[[], str], generation: Callable[[], int]
    ) -> None:
        self.log = log
        self.refusals = refusals
        self.why_not_restart = why_not_restart
        self.generation = generation  # this image's (0 before it has one)
        self.read_fd, self.write_fd = -1, -1
        self.stop = False  # a stop that releases the memory
        self.keep = False  # ending keeps the memory for the next start
        #: The daemon ends to execute itself again (``kvcached restart``): its caller does that.
        self.restart = False
        #: A stop's (or a stop keeping's) number, noted by its own handler: the pipe drops what comes when it is full.
        self.noted = 0
        self.logged_at = -LOG_EVERY_S  # when SIGUSR1 last logged the ranks (monotonic)

    def install(self) -> None:
        self.read_fd, self.write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        handled = (*STOP_SIGNALS, KEEP_SIGNAL, RESTART_SIGNAL, LOG_SIGNAL)
        for signum in (*handled, signal.SIGCHLD):
            signal.signal(signum, lambda *_: None)  # the wake-up fd carries the signal number
        for signum in (*STOP_SIGNALS, KEEP_SIGNAL):
            signal.signal(signum, self._note)
        # Held pending by the image before, if a restart executed this one (a mask survives ``execv``).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)

    def fileno(self) -> int:
        return self.read_fd

    def read(self, log_ranks: Callable[[str], None]) -> bool:
        """Take up to ``READ_BYTES`` of what the pipe holds (a flood of signals leaves the loop its other work); True
        when a signal asks the daemon to end now. ``log_ranks`` logs each rank's state (SIGUSR1, at most every
        ``LOG_EVERY_S``: a flood is drained quickly, and its log stays small), given the signal's name."""
        try:
            data = os.read(self.read_fd, READ_BYTES)
        except BlockingIOError:
            return False
        for at, signum in enumerate(data):
            if signum in STOP_SIGNALS or signum == KEEP_SIGNAL:
                self._end(signum)
                return True
            if signum == RESTART_SIGNAL and self._accept_restart():
                self._overrule_restart(data[at + 1 :])
                return True
            if signum == LOG_SIGNAL and time.monotonic() >= self.logged_at + LOG_EVERY_S:
                log_ranks(signal_name(signum))
                self.logged_at = time.monotonic()
        if self.noted:  # its number was dropped by a full pipe, or is still behind a flood's
            self._end(self.noted)
            return True
        return False

    def _note(self, signum: int, _frame: object) -> None:
        if signum in STOP_SIGNALS or not self.noted:  # a stop outranks a stop keeping
            self.noted = signum

    def _end(self, signum: int) -> None:
        """A stop (``STOP_SIGNALS``: the memory released) or a stop keeping it (``KEEP_SIGNAL``)."""
        if signum == KEEP_SIGNAL:
            self.keep = True
            self.log.info("stopping, keeping the memory for the next start", signal=signal_name(signum))
        else:
            self.stop = True
            self.log.info("stopping", signal=signal_name(signum))

    def _overrule_restart(self, rest: bytes) -> None:
        """A restart was accepted (the request signals blocked from now on): a stop that came while the next image was
        checked, or after the restart signal in the same read, is never dropped: the later word wins, the daemon ends as
        that stop asks instead of executing itself again."""
        rest += self._drain()
        ends = [signum for signum in rest if signum in STOP_SIGNALS or signum == KEEP_SIGNAL]
        if self.noted:  # one whose number the pipe dropped
            ends.append(self.noted)
        if not ends:
            return
        signum = next((s for s in ends if s in STOP_SIGNALS), ends[0])  # a stop outranks a stop keeping
        self.log.warning("a stop came while the restart was checked: stopping instead of restarting")
        self.restart = self.keep = False
        self._end(signum)

    def pass_on_pending(self) -> None:
        """Just before the restart's ``execv``: a request that reached the pipe (or a stop's handler) after the restart
        was accepted, through a thread not blocking it, is raised again on this thread, to stay pending across the exec
        for the next image."""
        for signum in {*self._drain(), self.noted} & handover.REQUEST_SIGNALS:
            signal.pthread_kill(threading.get_ident(), signum)

    def _drain(self) -> bytes:
        """The signal numbers the pipe holds now, in order (one read of more than a pipe holds: a flood cannot prolong
        it)."""
        try:
            return os.read(self.read_fd, 1 << 20)
        except BlockingIOError:
            return b""

    def _accept_restart(self) -> bool:
        """Whether to end now for ``kvcached restart``; when not, say why where the CLI reads it."""
        why = self.why_not_restart()
        if why:
            self.log.error("restart refused; serving on", reason=why)
            handover.record_outcome(self.refusals, self.generation(), why)
            return False
        # A stop, restart or SIGUSR1 sent from now on stays pending, across the exec, for the next image.
        signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
        handover.record_outcome(self.refusals, self.generation())  # one sent from now on is the next image's
        self.keep = self.restart = True
        faults.fault("restart-accepted")
        self.log.info("restarting, keeping the memory for the next image", signal="SIGUSR2")
        return True
