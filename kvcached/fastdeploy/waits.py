"""Every wait of the drop-in has a deadline and is logged while it lasts.

The drop-in waits on things it cannot interrupt: a call of FastDeploy's cache queue (a manager proxy that blocks while
the engine's queue server does not answer), the engine's connection at start, the tasks in flight before a pause, the
other side of the pause handshake. Each wait is entered with ``with waits.on(what, seconds):``; one watchdog thread logs
every wait that has lasted ``LOG_AFTER_S`` (and again every ``LOG_EVERY_S``) naming what it waits for, and when one
passes its deadline calls ``expire(what, seconds)``, which ends the rank (``TransferManager.end``): a wait that cannot
finish costs the rank, with a log line saying why, never a silent hang.

**A paused engine is not a dead one.** A wait on the engine (``engine=True``: its queue, its side of the pause
handshake) that passes its deadline ends the rank only once the engine is gone: while the process that launched the
drop-in (``Launcher``: FastDeploy's engine, which also holds the queue server, its child) lives, stopped (``SIGSTOP``, a
debugger), swapping or just slow, the drop-in waits on, logging every ``LOG_EVERY_S`` what it waits for and the engine's
state. A process that is gone, a zombie or another process under the same pid is gone."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator

from kvcached.protocol.proc import start_time

log = logging.getLogger("kvcached.fastdeploy")

LOG_AFTER_S = 5.0
LOG_EVERY_S = 10.0
TICK_S = 0.5
#: The shells FastDeploy's launcher may start the drop-in through (``subprocess.Popen(cmd, shell=True)``).
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh", "ash", "busybox"})
_STATES = {"R": "running", "S": "sleeping", "D": "in an uninterruptible wait", "T": "stopped", "t": "stopped"}


@dataclasses.dataclass(frozen=True, slots=True)
class Launcher:
    """The process that launched the drop-in (FastDeploy's engine), by (pid, start time)."""

    pid: int
    started: int

    @classmethod
    def find(cls, pid: int | None = None) -> Launcher | None:
        """The parent of ``pid`` (default: this process), past a shell; None when it cannot be read."""
        parent = _stat(pid if pid is not None else os.getpid())
        while parent is not None:
            ppid = int(parent[1][1])
            found = _stat(ppid)
            if found is None:
                return None
            if found[0] not in SHELLS:
                started = start_time(ppid)
                return cls(ppid, started) if started is not None else None
            parent = found
        return None

    def state(self) -> str | None:
        """How the launcher is ("pid 12 stopped"), or None once it is gone (or a zombie, or pid reused)."""
        found = _stat(self.pid)
        if found is None or start_time(self.pid) != self.started:
            return None
        return f"pid {self.pid} {_STATES.get(found[1][0], found[1][0])}"


def _stat(pid: int) -> tuple[str, list[str]] | None:
    """``(comm, fields after it)`` of ``/proc/<pid>/stat``; None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    comm = stat[stat.find("(") + 1 : stat.rfind(")")]
    return comm, stat[stat.rfind(")") + 2 :].split()


@dataclasses.dataclass(slots=True)
class _Wait:
    what: str
    started: float
    deadline: float
    logged: float
    seconds: float
    engine: bool


class Waits:
    """The waits in progress, by id. ``engine``: the engine's launcher, whose life extends waits on it."""

    def __init__(self, rank: int, expire: Callable[[str, float], None], engine: Launcher | None = None) -> None:
        self.rank, self.expire, self.engine = rank, expire, engine
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._waits: dict[int, _Wait] = {}
        self._thread = threading.Thread(target=self._watch, name="kvcached-waits", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def on(self, what: str, seconds: float, *, engine: bool = False) -> Iterator[None]:
        """Around a wait for ``what`` that must end within ``seconds`` (``engine``: unless the engine lives)."""
        key = next(self._ids)
        now = time.monotonic()
        with self._lock:
            self._waits[key] = _Wait(what, now, now + seconds, now, seconds, engine)
        try:
            yield
        finally:
            with self._lock:
                self._waits.pop(key, None)

    def _watch(self) -> None:
        while True:
            time.sleep(TICK_S)
            now = time.monotonic()
            with self._lock:
                waits = list(self._waits.values())
            for wait in waits:
                if now >= wait.deadline:
                    self._expired(wait, now)
                elif now - wait.started >= LOG_AFTER_S and (
                    wait.logged == wait.started or now - wait.logged >= LOG_EVERY_S
                ):
                    wait.logged = now
                    log.warning("rank %d waiting %.1fs for %s", self.rank, now - wait.started, wait.what)

    def _expired(self, wait: _Wait, now: float) -> None:
        """Past its deadline: end the rank, unless it waits on an engine that is still there."""
        state = self.engine.state() if wait.engine and self.engine is not None else None
        if state is None:
            self.expire(wait.what, now - wait.started)
            return
        wait.deadline, wait.logged = now + LOG_EVERY_S, now
        log.warning(
            "rank %d waiting %.0fs for %s, past its deadline (%gs): the engine (%s) is alive, so the drop-in waits on",
            self.rank,
            now - wait.started,
            wait.what,
            wait.seconds,
            state,
        )
