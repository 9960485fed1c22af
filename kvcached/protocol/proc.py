"""Process identity: a pid alone can be reused, a (pid, start time) pair cannot.

The start time is field 22 of ``/proc/<pid>/stat`` (clock ticks since boot). A zombie (state Z or X) counts as dead: it
will never publish again, even though its pid is still taken. Also here: a child's request to die with its parent, the
one polling wait (``until``), and the end of a process given a grace (``end``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def start_time(pid: int) -> int | None:
    """Start time of a running ``pid`` in clock ticks since boot; None if it is gone or a zombie."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X", b"x"):  # the state
        return None
    return int(fields[19])


def status_values(pid: int | str, name: str) -> list[str]:
    """The values on the ``name:`` line of ``/proc/<pid>/status`` (``pid`` "self": this process); [] when the
    process is gone or has no such line."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{name}:"):
                return line.split()[1:]
    return []


def is_alive(pid: int, started: int) -> bool:
    """True iff process ``pid`` runs and is the one that started at ``started``."""
    return started != 0 and start_time(pid) == started


def self_identity() -> tuple[int, int]:
    """This process's (pid, start time)."""
    pid = os.getpid()
    started = start_time(pid)
    assert started is not None, "a running process always has a start time"
    return pid, started


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> bool:
    """Have the kernel SIGKILL this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``); False when ``parent`` is
    already gone (this process was re-parented before the request took hold): the caller exits then."""
    import ctypes  # here: runner_client imports this module and needs none of it

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    return os.getppid() == parent


def until(ready: Callable[[], T], seconds: float, every: float = 0.01) -> T:
    """``ready()``, called every ``every`` seconds until it returns a true value, for ``seconds`` at most
    (it is called at least once, and once more as time runs out): its last value."""
    deadline = time.monotonic() + seconds
    while not (value := ready()) and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(every, left))
    return value


def _exited(pid: int, child: bool, started: int | None) -> bool:
    """Whether ``pid`` (which started at ``started``) has exited (a ``child`` reaped by this call)."""
    if not child:
        return start_time(pid) != started
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


def end(pids: list[int], seconds: float, *, child: bool) -> None:
    """Give the processes ``pids`` ``seconds`` to exit, then SIGKILL those left (with ``child``, all are reaped)."""
    started = {pid: start_time(pid) for pid in pids}  # (a pid reused meanwhile is another process)
    running = [pid for pid in pids if child or started[pid] is not None]

    def gone() -> bool:
        running[:] = [pid for pid in running if not _exited(pid, child, started[pid])]
        return not running

    until(gone, seconds)
    for pid in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        if child:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
