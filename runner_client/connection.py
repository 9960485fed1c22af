"""One connection to one rank worker's task socket: frames out, replies in, every step under a deadline.

A ``Connection`` is opened to the worker of one daemon (the control block it was found through stays with it), checks
who serves the socket, says HELLO with the daemon's generation, and then carries task frames
(``kvcached.protocol.messages``). Replies arrive in request order; a reply read while waiting for another task's is kept
for its own waiter, so tasks can be pipelined; a waiter whose reply another thread read on its way is woken at once
(``arrived``), and the reply of a task nobody waits for any more (``forget``) is dropped, not kept. What a closed
connection means (a daemon handing over, a worker replaced, a daemon gone) is the business of ``runner_client.link``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import select
import socket
import struct
import threading
import time
from typing import Any

from kvcached.protocol.control import ControlBlock, Record
from kvcached.protocol.errors import AccessDenied, DaemonGone, NotTrusted
from kvcached.protocol.messages import REPLY, REPLY_MAGIC, Op, Status, parse_reply_body, request
from kvcached.protocol.trust import admitted, check_owner, peer_credentials

#: Tasks a connection may have in flight (sent, reply unread): at the bound ``send`` first reads replies (kept for their
#: handles), so any number of tasks can be outstanding without both sides' socket buffers filling up and deadlocking.
MAX_IN_FLIGHT = 128
#: How long the first read of a reply blocks before the wait becomes a poll() until its deadline.
FAST_WAIT_S = 0.002


class Closed(Exception):
    """The rank's connection ended (EOF or reset), or its socket is not there."""


class AtCapacity(Exception):
    """The worker refused the connection: it has as many open as it takes, none of them idle."""


class Full(Exception):
    """``MAX_IN_FLIGHT`` replies were unread and none came by the sender's deadline: nothing was sent or changed."""


class Connection:
    """One connection to one rank worker; frames are sent under ``send_lock`` and replies read under ``read_lock``, so
    a thread sending a task never waits behind a thread waiting for a reply. ``by`` (monotonic): the HELLO is given up
    (``TimeoutError``, the socket closed) if not answered by then. Raises, when it opens: ``Closed`` (no socket, or
    closed at once), ``NotTrusted`` (the socket or the process serving it is not the daemon's user's), ``AccessDenied``
    (this user may not connect, or the worker refused it), ``DaemonGone`` (the worker refused the HELLO: another
    generation), ``AtCapacity`` (the worker is at its connection cap)."""

    def __init__(self, path: str, rank: int, block: ControlBlock, timeout: float, by: float | None = None) -> None:
        self.rank = rank
        self.block = block  # of the daemon it is opened to (kept mapped while this client lives)
        generation, owner = block.header().generation, block.owner_uid
        self.timeout = timeout
        self.send_lock = threading.Lock()
        self.read_lock = threading.Lock()
        self.next_id = 1
        # Tasks sent and replies read (each changed under its own lock only): the difference is in flight.
        self.sent = 0
        self.read = 0
        # Replies read and not taken yet, and tasks whose replies nobody will take: changed under ``arrived``
        # (``forget`` only appends to ``unwanted``: it may run in a garbage collection, anywhere).
        self.early: dict[int, tuple[int, dict[str, Any]]] = {}
        self.arrived = threading.Condition(threading.Lock())
        self.unwanted: collections.deque[int] = collections.deque()
        self.forgotten: set[int] = set()
        self.buf = bytearray()
        self.worker_pid = 0  # the worker that took the connection (SO_PEERCRED)
        self.verdict: tuple[bool, Record | None] | None = None  # once it ended: the daemon alive, the record
        try:
            check_owner(f"task socket {path}", os.stat(path), owner=owner)
        except FileNotFoundError:
            raise Closed() from None
        self.sock = self._connect(path, owner)
        self.readable = select.poll()
        self.readable.register(self.sock.fileno(), select.POLLIN)
        self.writable = select.poll()
        self.writable.register(self.sock.fileno(), select.POLLOUT)
        hello = json.dumps({"generation": f"{generation:016x}"}).encode()
        deadline = self._deadline(by)
        try:
            try:
                task_id = self.send(Op.HELLO, hello, by=deadline)
            except Closed:
                # Closed at once: a refused peer gets one REFUSED frame first; wait() raises on it.
                self.wait(0, time.monotonic() + min(timeout, 1.0))
                raise
            status, body = self.wait(task_id, deadline)
        except BaseException:
            self.sock.close()
            raise
        if status != Status.OK:
            self.sock.close()
            raise DaemonGone(f"rank {rank}: the daemon's worker refused this client: {body.get('message')}")

    def _connect(self, path: str, owner: int) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(path)
            self.worker_pid, peer_uid, _ = peer_credentials(sock)
            if peer_uid != owner:
                raise NotTrusted(f"the process serving {path} runs as uid {peer_uid}, not the daemon's uid {owner}")
        except PermissionError:
            sock.close()
            raise AccessDenied(f"rank {self.rank}: no permission to connect to {path}: {admitted(path)}") from None
        except BaseException:
            sock.close()
            raise
        # A reply that comes within FAST_WAIT_S is read by one blocking recv() (one syscall on the latency path; a
        # poll() first adds two to every round trip); a longer wait, and a send with no room, is a poll() until the
        # deadline. A blocking call's own timeout (SO_RCVTIMEO, SO_SNDTIMEO) restarts whenever a signal interrupts it,
        # so a runner signalled more often (a sampling profiler's timer) would never time out; poll's is recomputed.
        sock.setblocking(True)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, int(FAST_WAIT_S * 1e6)))
        return sock

    def send(self, op: Op, payload: bytes, flags: int = 0, *, by: float | None = None) -> int:
        """Send one task and return its id; at ``MAX_IN_FLIGHT`` unread replies, read some first (kept for their
        waiters), until ``by`` at the latest. Raises ``Closed`` (the worker is gone: it runs none of it),
        ``TimeoutError`` (the worker reads nothing any more, or ``by`` passed while the frame went out: the connection
        is closed, part of a frame may be out) or ``Full`` (``by`` passed first: another thread's frame was going out,
        or no room in flight)."""
        deadline = self._deadline(by)
        if not self.send_lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise Full()
        try:
            try:
                while self.sent - self.read >= MAX_IN_FLIGHT:
                    # Until ``deadline`` only: another thread may read for its own reply longer than this one may wait.
                    if not self.read_lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
                        raise TimeoutError
                    try:
                        if self.sent - self.read >= MAX_IN_FLIGHT:
                            self._read_reply(deadline)
                    finally:
                        self.read_lock.release()
                        with self.arrived:
                            self.arrived.notify_all()  # a waiter may read now
            except TimeoutError:
                raise Full() from None
            task_id = self.next_id
            self.next_id += 1
            self._send_frame(request(op, task_id, payload, flags), deadline)
            self.sent += 1
            return task_id
        finally:
            self.send_lock.release()

    def _send_frame(self, frame: bytes, deadline: float) -> None:
        """Send all of ``frame``: ``TimeoutError`` once the worker has taken none of it for the connection's timeout,
        or at ``deadline`` when nearer (part of the frame may be out: the connection is closed). Holds ``send_lock``."""
        short = deadline < time.monotonic() + self.timeout - 0.001
        view = memoryview(frame)
        while view:
            try:
                view = view[self.sock.send(view, socket.MSG_DONTWAIT) :]
            except BlockingIOError:
                if not self._wait_for(self.writable, deadline if short else time.monotonic() + self.timeout):
                    self.close()
                    raise TimeoutError from None
            except OSError as exc:  # a broken pipe, a reset, or closed by another thread (``close``)
                raise Closed() from exc

    def _wait_for(self, poller: select.poll, deadline: float) -> bool:
        """Whether the socket became ready (``poller``'s event, or closed) before ``deadline``."""
        remaining = deadline - time.monotonic()
        return remaining > 0 and bool(poller.poll(math.ceil(remaining * 1000)))

    def wait(self, task_id: int, deadline: float) -> tuple[int, dict[str, Any]]:
        """The (status, body) of ``task_id``, reading and keeping other tasks' replies on the way; while another thread
        reads, its reply is taken once that thread has read it. Raises ``Closed``, ``TimeoutError`` at ``deadline``,
        ``AccessDenied`` / ``AtCapacity`` for a refusal."""
        with self.arrived:
            while task_id not in self.early:
                if self.read_lock.acquire(blocking=False):
                    break  # nobody reads: this thread does
                if (
                    not self.arrived.wait(timeout=max(deadline - time.monotonic(), 0.0))
                    and time.monotonic() >= deadline
                ):
                    raise TimeoutError
            else:
                return self.early.pop(task_id)
        try:
            while True:
                with self.arrived:
                    if task_id in self.early:
                        return self.early.pop(task_id)
                self._read_reply(deadline)
        finally:
            self.read_lock.release()
            with self.arrived:
                self.arrived.notify_all()  # another waiter may read now

    def forget(self, task_id: int) -> None:
        """Nobody will take ``task_id``'s reply: drop it (now, or when it comes). Safe anywhere, also in a
        garbage collection while this thread holds the connection's locks."""
        self.unwanted.append(task_id)

    def _deadline(self, by: float | None) -> float:
        """This connection's timeout from now, or ``by`` when that comes first."""
        limit = time.monotonic() + self.timeout
        return limit if by is None else min(limit, by)

    def close(self) -> None:
        """Close it, from any thread: a thread blocked reading it wakes up and raises ``Closed``."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _fill(self, deadline: float) -> None:
        """Append at least one byte from the socket to ``self.buf``, or raise TimeoutError at ``deadline``."""
        # The first recv blocks (FAST_WAIT_S at most) unless the deadline is nearer; the later ones follow a poll.
        flags = 0 if deadline - time.monotonic() > FAST_WAIT_S else socket.MSG_DONTWAIT
        while True:
            try:
                chunk = self.sock.recv(1 << 16, flags)
            except BlockingIOError:
                if not self._wait_for(self.readable, deadline):
                    raise TimeoutError from None
                flags = socket.MSG_DONTWAIT
                continue
            except (ConnectionResetError, OSError) as exc:
                raise Closed() from exc
            if not chunk:
                raise Closed()
            self.buf += chunk
            return

    def _read_reply(self, deadline: float) -> None:
        """Read one reply into ``early``. Caller holds ``read_lock``."""
        while len(self.buf) < REPLY.size:
            self._fill(deadline)
        magic, op, status, got_id, length = REPLY.unpack_from(self.buf)
        if magic != REPLY_MAGIC:
            raise Closed()
        while len(self.buf) < REPLY.size + length:
            self._fill(deadline)
        body = parse_reply_body(op, status, bytes(self.buf[REPLY.size : REPLY.size + length]))
        del self.buf[: REPLY.size + length]
        if status == Status.REFUSED:
            if body.get("reason") == "capacity":
                raise AtCapacity(f"rank {self.rank}: the worker refused the connection: {body.get('message')}")
            raise AccessDenied(f"rank {self.rank}: the daemon refused this client: {body.get('message')}")
        self.read += 1
        with self.arrived:
            while self.unwanted:
                unwanted = self.unwanted.popleft()
                if self.early.pop(unwanted, None) is None:
                    self.forgotten.add(unwanted)
            if got_id in self.forgotten:
                self.forgotten.discard(got_id)
            else:
                self.early[got_id] = (status, body)
            self.arrived.notify_all()
