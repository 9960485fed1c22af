"""What /proc shows of the processes a test started: one reader of ``/proc/<pid>/stat`` for the tests."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Proc:
    """One process as ``/proc/<pid>/stat`` and ``cmdline`` show it (``started``: clock ticks after boot, which
    tells a process from a later one given the same pid)."""

    pid: int
    parent: int
    session: int
    started: int
    state: str
    command: str

    def alive(self) -> bool:
        """Whether this very process still runs (not a zombie, not a later one under its pid)."""
        now = proc(self.pid)
        return now is not None and now.started == self.started and now.state != "Z"


def proc(pid: int) -> Proc | None:
    """Process ``pid``, or None when there is none."""
    try:
        fields = _stat(Path(f"/proc/{pid}/stat"))
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return Proc(pid, int(fields[1]), int(fields[3]), int(fields[19]), fields[0], command)


def _stat(path: Path) -> list[str]:
    """The fields of a ``stat`` file of /proc after the command's name (the state letter first)."""
    return path.read_text().rsplit(")", 1)[1].split()


def descendants(pid: int) -> dict[int, Proc]:
    """Every process below ``pid`` now: pid -> Proc."""
    table = {p.pid: p for p in map(proc, (int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit())) if p}
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.parent, []).append(p.pid)
    found, todo = {}, list(children.get(pid, []))
    while todo:
        child = todo.pop()
        found[child] = table[child]
        todo += children.get(child, [])
    return found


def halt(pid: int, timeout: float = 10.0) -> None:
    """Stop process ``pid`` (``SIGSTOP``) and return once every thread of it is stopped (or it is gone).
    ``kill`` returns before they are: a thread running on another CPU runs on, here up to 18 ms under load,
    long enough to answer a request sent just after, as if the process had not been stopped yet."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not all(state in "Tt" for state in _thread_states(pid)):
        assert time.monotonic() < deadline, f"process {pid} has threads still running {timeout}s after SIGSTOP"
        time.sleep(0.001)


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """Process ``pid`` stopped (``halt``) for the block, and continued after it whatever happens."""
    halt(pid)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def _thread_states(pid: int) -> list[str]:
    """The state letter of each thread of ``pid`` now (none when it is gone)."""
    states = []
    with contextlib.suppress(FileNotFoundError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                states.append(_stat(task / "stat")[0])
    return states


def why_hung(popen: subprocess.Popen[str]) -> str:
    """What a process that would not end shows: its state and signal masks from /proc, each thread's wait
    channel, then (sent SIGABRT) what Python's fault handler printed of every thread's stack on its
    stderr, a pipe, when the process was started with ``PYTHONFAULTHANDLER=1``. The process ends."""
    wanted = ("State", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt", "Threads")
    lines = []
    with contextlib.suppress(OSError):
        status = Path(f"/proc/{popen.pid}/status").read_text().splitlines()
        lines = [line for line in status if line.split(":")[0] in wanted]
        for task in Path(f"/proc/{popen.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                lines.append(f"thread {task.name}: {_stat(task / 'stat')[0]} {(task / 'wchan').read_text()}")
    popen.send_signal(signal.SIGABRT)
    try:
        popen.wait(10)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()
    stderr = popen.stderr.read() if popen.stderr else ""
    return "\n".join(lines) + "\n" + stderr[-8000:]
