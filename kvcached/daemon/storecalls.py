"""A rank's store calls with a deadline each, so that a slow or frozen backend fails its own task, never
the rank.

Every call of the rank's ``Store`` runs on one thread of the worker (opening it too: a Mooncake master
that does not answer at start-up leaves the rank READY, its store "connecting"). The worker's main
thread waits for a call in short slices, marking progress as it waits, until the call returns or goes
``timeout`` seconds without moving an object (``Store.on_progress``): a long call that keeps moving (a
store of 30,000 blocks) takes the time it needs, one that stops (a frozen master) fails its task with
``StoreUnavailable`` and is left to finish in the background. Until it does, store tasks fail at once
("still busy with a call that timed out").

The store thread never touches device memory: a put reads from a staging buffer the main thread filled,
a load writes into one the main thread then copies from. So a call that finishes after its task was
given up on cannot change a block another task has since reused.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvcached.logs import Logger
from kvcached.protocol.errors import StoreUnavailable
from kvcached.store.base import Store, StoreCounters

T = TypeVar("T")
#: How often the waiting main thread marks progress.
SLICE_S = 0.1


class StoreCalls:
    """The rank's store, behind one thread and a deadline per call."""

    def __init__(
        self, name: str, opener: Callable[[], Store], *, timeout_s: float, progress: Callable[[], None], log: Logger
    ) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self.progress = progress
        self.log = log
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcached-store")
        self.opening: concurrent.futures.Future[Store] = self.pool.submit(opener)
        self.store: Store | None = None
        self.stuck: tuple[concurrent.futures.Future[Any], float, str] | None = None
        self.moves = 0  # objects the store has moved (its on_progress calls, from the store thread)
        self.checking: concurrent.futures.Future[None] | None = None

    def wait_open(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the store to open; re-raise what opening raised. Returns quietly when
        it is still opening (the rank serves its other tiers meanwhile)."""
        try:
            self.store = self._wait(self.opening, seconds)
            self.store.on_progress = self._moved
        except TimeoutError:
            self.log.warning("attention store does not answer yet; store tasks fail until it does", backend=self.name)

    @property
    def counters(self) -> StoreCounters:
        return self.store.counters if self.store is not None else StoreCounters()

    def call(self, method: str, *args: Any) -> Any:
        """``store.<method>(*args)`` on the store thread, within the deadline. Raises ``StoreUnavailable``
        when the store is not open yet, still busy with a call that timed out, or does not answer in time."""
        now = time.monotonic()
        if self.stuck is not None:
            future, since, what = self.stuck
            if not future.done():
                raise StoreUnavailable(
                    f"the {self.name} store has not returned from a {what} call for {now - since:.0f}s; store tasks "
                    "fail until it does"
                )
            self.stuck = None
        if self.store is None:
            if not self.opening.done():
                self.stuck = (self.opening, now, "connect")
                raise StoreUnavailable(f"the {self.name} store is still connecting")
            self.store = self.opening.result()  # re-raises what opening raised
            self.store.on_progress = self._moved
        store = self.store
        future = self.pool.submit(lambda: getattr(store, method)(*args))
        try:
            return self._wait(future, self.timeout_s)
        except TimeoutError:
            self.stuck = (future, now, method)
            raise StoreUnavailable(
                f"the {self.name} store went {self.timeout_s:g}s without an answer in a {method} call"
            ) from None

    def maintain(self) -> None:
        """Let the store look for trouble outside any call (``Store.check``), without waiting for it."""
        if self.store is None or self.stuck is not None or (self.checking is not None and not self.checking.done()):
            return
        store, log = self.store, self.log

        def check() -> None:
            try:
                store.check()
            except Exception as exc:  # a check that fails is news for the log, not for the rank
                log.error("attention store check failed", reason=str(exc))

        self.checking = self.pool.submit(check)

    def _moved(self) -> None:
        self.moves += 1

    def _wait(self, future: concurrent.futures.Future[T], seconds: float) -> T:
        """The future's result; TimeoutError once it went ``seconds`` without the store moving an object."""
        deadline, moves = time.monotonic() + seconds, self.moves
        while True:
            try:
                return future.result(timeout=max(0.0, min(SLICE_S, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                self.progress()
                if self.moves != moves:
                    deadline, moves = time.monotonic() + seconds, self.moves
                elif time.monotonic() >= deadline:
                    raise TimeoutError from None

    def close(self) -> None:
        """Close the store if it is idle; a call still stuck is abandoned (the process is ending)."""
        if self.store is not None and self.stuck is None:
            self.pool.submit(self.store.close)
        self.pool.shutdown(wait=self.stuck is None, cancel_futures=True)
