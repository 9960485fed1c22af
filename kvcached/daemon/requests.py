"""The signals a running daemon takes, and what each asks of it (``kvcached stop`` and ``kvcached restart`` send them;
an operator or a unit may send them with ``kill``).

=================================  =====================================================================
SIGTERM, SIGINT, SIGHUP, SIGQUIT   stop: every rank STOPPING, workers stopped, every object removed
``KEEP_SIGNAL`` (SIGRTMIN+1)       stop, keeping the memory for the next start: every rank KEPT, workers
                                   stopped after running what clients sent, the arenas, pools, key
                                   directories and the control block left for ``kvcached start`` to adopt
``RESTART_SIGNAL`` (SIGUSR2)       as ``KEEP_SIGNAL``, then the daemon executes itself again (same pid,
                                   same arguments, the code now installed) and adopts what it kept;
                                   refused (the daemon serves on) while a rank is not READY or when the
                                   next image could not load its configuration (``kvcached.daemon.handover``)
SIGUSR1                            log each rank's state
=================================  =====================================================================
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
KEEP_SIGNAL: int = signal.SIGRTMIN + 1
RESTART_SIGNAL = signal.SIGUSR2
LOG_SIGNAL = signal.SIGUSR1


def name(signum: int) -> str:
    """A signal's name for the log ("SIGTERM", "SIGRTMIN+1")."""
    if signal.SIGRTMIN <= signum <= signal.SIGRTMAX:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}"
    return signal.Signals(signum).name
