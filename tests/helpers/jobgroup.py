"""``python jobgroup.py PARENT_PID COMMAND...``: run COMMAND; its whole process group ends with the test process.

The leader of a process group of its own (its starter passes ``start_new_session``), it runs COMMAND in that
group and exits as COMMAND exits (the same status, a signal raised again). When the process that started it
(PARENT_PID) dies, kill -9 included, or when it is sent SIGTERM, it ends the group as a terminal's Ctrl-C
would, then for certain: SIGINT to every process of the group (pip removes its temporary directories, a
benchmark stops its daemons and masters), ``GRACE_S`` for them to exit, then SIGKILL to what is left. A
process that made a session of its own (a daemon's store keeper) is not in the group: its own owner ends it.

Run as a script, by path (not ``-m``): it imports nothing of the project, whatever the working directory.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType

GRACE_S = 10.0
PR_SET_PDEATHSIG = 1


class Stop(Exception):
    """SIGTERM: the test process ended, or asks the group to end."""


def _stop(signum: int, frame: FrameType | None) -> None:
    raise Stop


def others() -> list[int]:
    """The live processes of this group other than this one."""
    group, me, found = os.getpgrp(), os.getpid(), []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me:
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def reap() -> None:
    """Reap this process's children that have exited (none is left a zombie for the caller to find)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def end_group() -> None:
    """SIGINT to the group, ``GRACE_S`` for it to go, then SIGKILL to the group (this process too)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGINT)
    deadline = time.monotonic() + GRACE_S
    while others() and time.monotonic() < deadline:
        time.sleep(0.05)
        reap()
    reap()
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> int:
    parent, command = int(argv[0]), argv[1:]
    signal.signal(signal.SIGINT, lambda signum, frame: None)  # handled, not ignored: COMMAND gets the default
    signal.signal(signal.SIGTERM, _stop)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # it died before the line above
            raise Stop
        try:
            child = subprocess.Popen(command)
        except OSError as exc:
            print(f"jobgroup: {command[0]}: {exc.strerror}", file=sys.stderr)
            return 127
        code = child.wait()
    except Stop:
        end_group()
        return 1  # not reached: end_group killed this process
    if code < 0:  # COMMAND was killed by a signal: so is this process, as the caller would see COMMAND
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
