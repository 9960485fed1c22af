"""Every wait of the drop-in has a deadline and is logged while it lasts.

The drop-in waits on things it cannot interrupt: a call of FastDeploy's cache queue (a manager proxy that
blocks while the engine's queue server does not answer), the engine's connection at start, the tasks in
flight before a pause, the other side of the pause handshake. Each wait is
entered with ``with waits.on(what, seconds):``; one watchdog thread logs every wait that has lasted
``LOG_AFTER_S`` (and again every ``LOG_EVERY_S``) naming what it waits for, and when one passes its
deadline calls ``expire(what, seconds)``, which ends the rank (``TransferManager.end``): a wait that
cannot finish costs the rank, with a log line saying why, never a silent hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("kvcached.fastdeploy")

LOG_AFTER_S = 5.0
LOG_EVERY_S = 10.0
TICK_S = 0.5


@dataclasses.dataclass(slots=True)
class _Wait:
    what: str
    started: float
    deadline: float
    logged: float


class Waits:
    """The waits in progress, by id."""

    def __init__(self, rank: int, expire: Callable[[str, float], None]) -> None:
        self.rank = rank
        self.expire = expire
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._waits: dict[int, _Wait] = {}
        self._thread = threading.Thread(target=self._watch, name="kvcached-waits", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def on(self, what: str, seconds: float) -> Iterator[None]:
        """Around a wait for ``what`` that must end within ``seconds``."""
        key = next(self._ids)
        now = time.monotonic()
        with self._lock:
            self._waits[key] = _Wait(what, now, now + seconds, now)
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
                expired = [wait for wait in self._waits.values() if now >= wait.deadline]
                for wait in self._waits.values():
                    if now - wait.started >= LOG_AFTER_S and (
                        wait.logged == wait.started or now - wait.logged >= LOG_EVERY_S
                    ):
                        wait.logged = now
                        log.warning("rank %d waiting %.1fs for %s", self.rank, now - wait.started, wait.what)
            for wait in expired:
                self.expire(wait.what, now - wait.started)
