"""A rank's attention store, run in a helper process of its worker, with a deadline on every call: a slow or frozen
backend fails its own task, never the rank.

Why a process and not a thread: a store's client may block *holding the interpreter lock* (Mooncake's ``setup()`` does,
against a frozen master), which would freeze a thread's whole process. So the worker forks a store agent when it opens
its store; the agent opens the backend and serves calls sent over a socket pair. The worker waits for a reply in short
slices, marking its own progress as it waits, until the call returns or goes ``timeout`` seconds without moving an
object (the backend calls ``Store.on_progress``; the agent counts in a word both processes map): a long call that keeps
moving (a store of 30,000 blocks) takes the time it needs, one that stops (a frozen master) fails its task with
``StoreUnavailable``. While that call has not returned, store tasks fail at once ("still busy"); an agent stuck past
``ABANDON_AFTER`` timeouts is killed and a new one started.

Block records never cross the socket: the agent reads and writes the device blocks themselves where the backend is
``direct`` (through the worker's mapping it inherits at the fork), else rows of ``staging``, memory both processes
share, created before the fork (docs/architecture.md, "The store path"). A direct call that times out has its agent
killed, and waited for, before its task fails, so that no write it had under way lands in a block the task gave up; a
staging agent never touches device memory, so a call that finishes after its task was given up on cannot change a block
another task has since reused.

Calls and replies are pickled tuples, one a frame (``kvcached.protocol.framing``); every reply carries the store's
counters. When idle, the agent checks its store for trouble (``Store.check``) once a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import pickle
import select
import signal
import socket
import time
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from kvcached.copy_engine import DeviceBlocks
from kvcached.daemon import faults
from kvcached.logs import Logger
from kvcached.memory import shm
from kvcached.native import Side
from kvcached.protocol import framing
from kvcached.protocol.errors import StoreBusy, StoreUnavailable
from kvcached.protocol.layout import round_up
from kvcached.protocol.proc import die_with_parent, end
from kvcached.store.base import Store, StoreCounters
from kvcached.store.landing import Targets

#: How often the waiting worker marks its own progress and looks at the agent's.
SLICE_S = 0.1
#: An agent whose timed-out call has not returned after this many timeouts is killed and replaced.
ABANDON_AFTER = 6
#: The calls that read or write device blocks (``direct``).
DIRECT_CALLS = ("put_blocks", "load_blocks")
#: After an agent could not open its store the next starts this much later, twice as late after each failure.
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 60.0


def _frame(message: Any) -> bytes:
    """``message`` as one frame of the agent's channel (a pickle: both ends are this program)."""
    return framing.frame(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


_COUNTER_NAMES = tuple(field.name for field in dataclasses.fields(StoreCounters))


def _counters(counters: StoreCounters) -> dict[str, int]:
    """``counters`` as the worker takes them (``dataclasses.asdict`` costs a call 25 us more)."""
    return {name: getattr(counters, name) for name in _COUNTER_NAMES}


def _reader() -> framing.Reader:
    return framing.Reader(framing.AGENT, "store agent")


def _next(frames: framing.Reader) -> Any | None:
    body = frames.next()
    return None if body is None else pickle.loads(body)


class StoreCalls:
    """The worker's side: sends calls to the store agent and waits for them within the deadline."""

    def __init__(
        self,
        name: str,
        opener: Callable[[], Store],
        *,
        record_bytes: int,
        staging_bytes: int,
        timeout_s: float,
        progress: Callable[[], None],
        log: Logger,
        device: DeviceBlocks | None = None,
    ) -> None:
        self.name = name
        self.opener = opener
        self.timeout_s = timeout_s
        self.progress = progress
        self.log = log
        rows = max(1, staging_bytes // record_bytes)
        self._staging_map = mmap.mmap(-1, round_up(rows * record_bytes))  # shared with the agent
        self.staging = np.frombuffer(self._staging_map, np.uint8, rows * record_bytes).reshape(rows, record_bytes)
        self._moves_map = mmap.mmap(-1, mmap.PAGESIZE)
        self._moves = memoryview(self._moves_map).cast("Q")
        self.device = device
        #: Store and load calls name device blocks (``put_blocks``, ``load_blocks``) instead of staging rows.
        self.direct = device is not None
        self.counters = StoreCounters()
        self.sock: socket.socket | None = None  # the agent's pid, socket, frames and open state: ``_spawn``
        self.next_seq = 1
        self.waiting_for: tuple[int, float, str] | None = None  # a call that timed out: (seq, since, method)
        #: Why the last agent could not open its store, when the next starts (None: one runs), and the back-off.
        self.open_error: str | None = None
        self.retry_at: float | None = None
        self.retry_s = RETRY_FIRST_S
        self._spawn()

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the agent: it must never return into the worker's code, whatever happens
            try:
                ours.close()
                _agent_main(theirs, parent, self)
            finally:
                os._exit(0)
        theirs.close()
        ours.setblocking(False)
        self.pid, self.sock, self.frames = pid, ours, _reader()
        self.opened, self.waiting_for, self.retry_at = False, None, None
        self.counters = dataclasses.replace(self.counters, unavailable=1)  # until the store is open

    def _kill_agent(self, why: str) -> None:
        self.log.error("attention store agent stuck; starting a new one", agent_pid=self.pid, reason=why)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        if self.sock is not None:
            self.sock.close()
        self._spawn()

    def _not_open(self) -> str:
        when = "" if self.retry_at is None else f" (trying again in {max(0.0, self.retry_at - time.monotonic()):.1f}s)"
        return f"the {self.name} store cannot open: {self.open_error}{when}"

    def wait_open(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the store to open; raise what opening raised (``StoreBusy``, ``OSError``...).
        Still opening: return quietly (the rank serves its other tiers, store tasks fail until it answers)."""
        deadline = time.monotonic() + seconds
        while not self.opened:
            message = self._receive(max(0.0, deadline - time.monotonic()))
            if message is None:
                self.log.warning(
                    "attention store does not answer yet; store tasks fail until it does", backend=self.name
                )
                return
            self._absorb(message)

    def close(self) -> None:
        """Stop the agent: it closes its store (5 s at most); an agent still opening its store (a Mooncake
        master that does not answer its keeper's setup) has nothing to close and is killed at once."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        end([self.pid], 5 if self.opened else 0, child=True)

    def call(self, method: str, *args: Any) -> Any:
        """``store.<method>(*args)`` in the agent (see ``_dispatch`` for the methods and their arguments),
        within the deadline. Raises ``StoreUnavailable`` when the store is not open yet, still busy with a
        call that timed out, or makes no progress for ``timeout`` seconds; re-raises the store's errors."""
        self.maintain()
        if self.open_error is not None and not self.opened:
            raise StoreUnavailable(self._not_open())
        if self.waiting_for is not None:
            seq, since, what = self.waiting_for
            stuck = time.monotonic() - since
            if stuck > ABANDON_AFTER * self.timeout_s:
                self._kill_agent(f"a {what} call has not returned for {stuck:.0f}s")
            raise StoreUnavailable(
                f"the {self.name} store has not returned from a {what} call for {stuck:.0f}s; "
                "store tasks fail until it does"
            )
        if not self.opened:
            self.waiting_for = (0, time.monotonic(), "connect")
            raise StoreUnavailable(f"the {self.name} store is still connecting")
        seq = self.next_seq
        self.next_seq += 1
        self._send((seq, method, args))
        deadline, moves = time.monotonic() + self.timeout_s, self._moves[0]
        while True:
            message = self._receive(SLICE_S)
            self.progress()
            if message is not None:
                if message[0] == "reply" and message[1] == seq:
                    return self._result(message)
                self._absorb(message)
                continue
            if self._moves[0] != moves:
                deadline, moves = time.monotonic() + self.timeout_s, self._moves[0]
            elif time.monotonic() >= deadline:
                why = f"the {self.name} store went {self.timeout_s:g}s without progress in a {method} call"
                if method in DIRECT_CALLS:  # it may still write device blocks: it must be gone first
                    self._kill_agent(why)
                    raise StoreUnavailable(f"{why}; its agent was stopped and a new one is starting")
                self.waiting_for = (seq, time.monotonic() - self.timeout_s, method)
                raise StoreUnavailable(why)

    @property
    def unavailable(self) -> bool:
        """Whether store tasks fail now: the store found its backend unavailable, or a call that timed out (a frozen
        master) still holds the agent (the agent's own counters, sent between calls, cannot say so while it is held)."""
        return bool(self.counters.unavailable) or self.waiting_for is not None or self.retry_at is not None

    def _result(self, message: tuple[Any, ...]) -> Any:
        _, _, ok, value, counters = message
        self.counters = StoreCounters(**counters)
        if ok:
            return value
        kind, text, code = value
        if kind in ("StoreUnavailable", "InvalidSpec", "InvalidConfig"):  # a refusal's text names the field and fix
            raise StoreUnavailable(text)
        if kind == "StoreBusy":
            raise StoreBusy(text)
        if code is not None:
            raise OSError(code, text)
        raise RuntimeError(f"{kind}: {text}")

    def _absorb(self, message: tuple[Any, ...]) -> None:
        """An unsolicited message, or the late reply of a call that timed out."""
        kind = message[0]
        if kind == "opened":
            _, error, counters = message
            if error is not None:
                if error[1] != self.open_error:
                    self.log.error("attention store cannot open", backend=self.name, reason=error[1])
                self.open_error = error[1]
                self._result(("reply", 0, False, error, counters))
            self.counters = StoreCounters(**counters)
            self.opened = True
            if self.open_error is not None:
                self.log.info("attention store open again", backend=self.name)
            self.open_error, self.retry_s = None, RETRY_FIRST_S
            if self.waiting_for is not None and self.waiting_for[0] == 0:
                self.waiting_for = None
        elif kind == "counters":
            self.counters = StoreCounters(**message[1])
        elif kind == "reply":
            self.counters = StoreCounters(**message[4])
            if self.waiting_for is not None and self.waiting_for[0] == message[1]:
                self.waiting_for = None  # the stuck call finished: the store takes calls again

    def maintain(self) -> None:
        """Take in every message received (counters after the agent's idle checks), without waiting; start the next
        agent when one that could not open its store waited its back-off. An agent found dead here (killed while idle)
        was already replaced by ``_receive``, at no further cost: the next call finds it opened or opening."""
        try:
            while self.sock is not None and (message := self._receive(0.0)) is not None:
                with contextlib.suppress(StoreUnavailable, StoreBusy, OSError, RuntimeError):
                    self._absorb(message)
        except StoreUnavailable:
            pass
        if self.retry_at is not None and time.monotonic() >= self.retry_at:  # after one that could not open
            self._spawn()

    def _send(self, message: Any) -> None:
        assert self.sock is not None
        self.sock.setblocking(True)
        self.sock.settimeout(self.timeout_s)
        try:
            self.sock.sendall(_frame(message))
        except OSError:
            self._kill_agent("cannot send it a call")
            raise StoreUnavailable(f"the {self.name} store agent did not take the call; it was restarted") from None
        finally:
            self.sock.setblocking(False)

    def _receive(self, seconds: float) -> tuple[Any, ...] | None:
        assert self.sock is not None
        deadline = time.monotonic() + seconds
        while True:
            message = _next(self.frames)
            if message is not None:
                assert isinstance(message, tuple)
                return message
            if not select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            try:
                chunk = self.sock.recv(1 << 20)
            except BlockingIOError:
                continue
            except OSError:  # a reset: the agent died with our call unread
                chunk = b""
            if not chunk and self.open_error is not None and not self.opened:
                # It said why it could not open its store (logged once: ``_absorb``), and exited: reap it; the next
                # starts ``retry_s`` later (``maintain``), twice as late after each failure in a row.
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.pid, 0)
                self.sock.close()
                self.sock, self.retry_at = None, time.monotonic() + self.retry_s
                self.retry_s = min(RETRY_MAX_S, 2 * self.retry_s)
                raise StoreUnavailable(self._not_open())
            if not chunk:  # the agent died: start another; this call fails
                self._kill_agent("it exited")
                raise StoreUnavailable(f"the {self.name} store agent died; a new one is starting")
            self.frames.feed(chunk)


def _agent_main(sock: socket.socket, parent: int, calls: StoreCalls) -> NoReturn:
    """The store agent's whole life: open the store, then serve calls until the worker goes."""
    if not die_with_parent(parent):  # it dies with the worker, holds none of its descriptors but ``sock``
        os._exit(1)
    keep = sock.fileno()
    os.closerange(3, keep)  # the worker's sockets and clients are not the agent's to hold open
    with contextlib.suppress(OSError):
        os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the supervisor's
    sock.setblocking(True)
    # ``calling[0]``: the method under way (``load-step`` slows loads only; ``store-step`` every call).
    slow, slow_load, calling = faults.hook("store-step"), faults.hook("load-step"), [""]

    def send(message: Any) -> None:
        try:
            sock.sendall(_frame(message))
        except OSError:
            os._exit(0)  # the worker is gone

    def moved() -> None:  # the store's mark of an object moved
        calls._moves[0] += 1
        if slow is not None:
            slow()
        if slow_load is not None and calling[0].startswith("load"):
            slow_load()

    try:
        store = calls.opener()
    except BaseException as exc:  # the worker reports it (StoreBusy fails the rank's start)
        send(("opened", _describe(exc), _counters(StoreCounters())))
        os._exit(0)
    store.on_progress = moved
    if calls.device is not None:  # page tables of the inherited mapping, so the first loads take no faults
        shm.prefault_ranges(calls.device.ranges())
    send(("opened", None, _counters(store.counters)))
    _serve(sock, store, calls, send, calling)


def _serve(
    sock: socket.socket, store: Store, calls: StoreCalls, send: Callable[[Any], None], calling: list[str]
) -> NoReturn:
    """Serve calls until the worker closes its end; between calls, check the store once a second.
    ``calling[0]`` names the method under way (for the ``load-step`` fault)."""
    frames = _reader()
    last = _counters(store.counters)
    while True:
        if not select.select([sock], [], [], 1.0)[0]:
            with contextlib.suppress(Exception):
                store.check()
            now = _counters(store.counters)
            if now != last:
                send(("counters", now))
                last = now
            continue
        try:
            chunk = sock.recv(1 << 20)
        except OSError:
            chunk = b""
        if not chunk:
            with contextlib.suppress(Exception):
                store.close()
            os._exit(0)
        frames.feed(chunk)
        while (message := _next(frames)) is not None:
            seq, method, args = message
            calling[0] = method
            try:
                reply: Any = ("reply", seq, True, _dispatch(store, calls, method, args))
            except BaseException as exc:
                reply = ("reply", seq, False, _describe(exc))
            last = _counters(store.counters)
            send((*reply, last))


def _dispatch(store: Store, calls: StoreCalls, method: str, args: tuple[Any, ...]) -> Any:
    """The calls the worker sends: ``put_many(keys)`` (records in staging rows 0..n-1), ``load_prefix(keys)`` (records
    into staging rows 0..), ``put_blocks(keys, ids)`` and ``load_blocks(keys, ids, ahead)`` (records in device blocks
    ``ids``, ``direct``; ``ahead``: the next load's keys, ``Store.expect``), ``present(keys)``, ``protect(keys)``."""
    if method == "put_blocks":
        keys, ids = args
        assert calls.device is not None
        return store.put_many(keys, [calls.device.record(block) for block in ids])
    if method == "load_blocks":
        keys, ids, ahead = args
        if ahead:
            store.expect(ahead)
        assert calls.device is not None
        return store.load_prefix(keys, Targets(calls.device.side, ids))
    if method == "put_many":
        (keys,) = args
        return store.put_many(keys, [[memoryview(calls.staging[i])] for i in range(len(keys))])
    if method == "load_prefix":
        (keys,) = args
        return store.load_prefix(keys, Targets(Side.of([calls.staging]), range(len(keys))))
    if method == "present":
        return store.present(args[0])
    if method == "protect":
        store.protect(args[0])
        return None
    raise ValueError(f"unknown store call {method!r}")


def _describe(exc: BaseException) -> tuple[str, str, int | None]:
    """(kind, text, errno) of an exception, for the worker to raise again: an ``OSError``'s text is its reason and file
    names without the ``[Errno N]`` its ``str`` begins with (the worker's ``OSError`` adds that once)."""
    if isinstance(exc, OSError) and exc.errno:
        names = "".join(f": {name}" for name in (exc.filename, exc.filename2) if name is not None)
        return type(exc).__name__, f"{exc.strerror or os.strerror(exc.errno)}{names}", exc.errno
    return type(exc).__name__, str(exc) or repr(exc), None
