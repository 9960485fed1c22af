"""One connection to one rank worker's task socket: frames out, replies in, every step under a deadline.

A ``Connection`` is opened to the worker of one daemon (the control block it was found through stays
with it), checks who serves the socket, says HELLO with the daemon's generation, and then carries task
frames (``kvcached.protocol.messages``). Replies arrive in request order; a reply read while waiting for
another task's is kept for its own waiter, so tasks can be pipelined; a waiter whose reply another thread
read on its way is woken at once (``arrived``), and the reply of a task nobody waits for any more
(``forget``) is dropped, not kept. What a closed connection means (a daemon handing over, a worker
replaced, a daemon gone) is the business of ``runner_client.link``.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import struct
import threading
import time
from typing import Any

from kvcached.protocol.control import ControlBlock
from kvcached.protocol.errors import AccessDenied, DaemonGone, NotTrusted, TaskFailed
from kvcached.protocol.messages import REPLY, REPLY_MAGIC, Op, Status, parse_reply_body, request
from kvcached.protocol.trust import admitted, check_owner, peer_credentials

#: Tasks a connection may have in flight (sent, reply not read yet). At the bound, ``send`` reads
#: replies (keeping them for their handles) before it sends more: any number of submitted tasks can be
#: outstanding without the two sides' socket buffers filling up and deadlocking.
MAX_IN_FLIGHT = 128


class Closed(Exception):
    """The rank's connection ended (EOF or reset), or its socket is not there."""


class Full(Exception):
    """``MAX_IN_FLIGHT`` replies were unread and none came by the sender's deadline: nothing was sent, and
    the connection is as it was."""


class Connection:
    """One connection to one rank worker; frames are sent under ``send_lock`` and replies read under
    ``read_lock``, so that a thread sending a task never waits behind a thread waiting for a reply. ``by``
    (monotonic): the HELLO is given up (``TimeoutError``, the socket closed) if not answered by then.

    Raises, when it opens: ``Closed`` (no socket, or closed at once), ``NotTrusted`` (the socket or the
    process serving it is not the daemon's user's), ``AccessDenied`` (this user may not connect, or the
    worker refused it), ``DaemonGone`` (the worker refused the HELLO: another generation), ``TaskFailed``
    (the worker is at its connection cap)."""

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
        try:
            check_owner(f"task socket {path}", os.stat(path), owner=owner)
        except FileNotFoundError:
            raise Closed() from None
        self.sock = self._connect(path, owner)
        self.rcvtimeo = 0.0
        self._set_rcvtimeo(timeout)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout))
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
            peer_uid = peer_credentials(sock)[1]
            if peer_uid != owner:
                raise NotTrusted(f"the process serving {path} runs as uid {peer_uid}, not the daemon's uid {owner}")
        except PermissionError:
            sock.close()
            raise AccessDenied(f"rank {self.rank}: no permission to connect to {path}: {admitted(path)}") from None
        except BaseException:
            sock.close()
            raise
        # Blocking with SO_RCVTIMEO / SO_SNDTIMEO instead of Python's timeout mode, which would poll()
        # before every recv(): one syscall less per reply on the latency path.
        sock.setblocking(True)
        return sock

    def send(self, op: Op, payload: bytes, flags: int = 0, *, by: float | None = None) -> int:
        """Send one task and return its id; at ``MAX_IN_FLIGHT`` unread replies, read some first (kept for
        their waiters), until ``by`` at the latest. Raises ``Closed`` (the worker is gone: it runs none of
        it), ``TimeoutError`` (the worker reads nothing any more: this connection is closed, part of a frame
        may be out, also when ``by`` passed while the frame was going out) or ``Full`` (``by`` passed before
        it could go out: another thread's frame was going out, or no room in flight)."""
        deadline = self._deadline(by)
        if not self.send_lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise Full()
        try:
            try:
                while self.sent - self.read >= MAX_IN_FLIGHT:
                    self._acquire_read(deadline)
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
        """``sendall`` within ``deadline`` (the socket's send timeout is lowered for this frame when the
        deadline is nearer than it). Caller holds ``send_lock``."""
        short = deadline < time.monotonic() + self.timeout - 0.001
        try:
            if short:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(deadline - time.monotonic()))
            self.sock.sendall(frame)
        except (BlockingIOError, TimeoutError):  # the send timeout expired: part of the frame may be out
            self.close()
            raise TimeoutError from None
        except OSError as exc:  # a broken pipe, a reset, or closed by another thread (``close``)
            raise Closed() from exc
        if short:  # the frame is out: a socket closed meanwhile is the next call's to find
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.timeout))

    def wait(self, task_id: int, deadline: float) -> tuple[int, dict[str, Any]]:
        """The (status, body) of ``task_id``, reading and keeping replies of other tasks on the way; while
        another thread reads, its reply is taken as soon as that thread has read it. Raises ``Closed``,
        ``TimeoutError`` at ``deadline``, ``AccessDenied`` / ``TaskFailed`` for a refusal."""
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

    def _acquire_read(self, deadline: float) -> None:
        """Take ``read_lock``, waited for at most until ``deadline`` (``TimeoutError``): another thread may
        be reading, for its own reply, longer than this caller may wait."""
        if not self.read_lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            raise TimeoutError

    def close(self) -> None:
        """Close it, from any thread: a thread blocked reading it wakes up and raises ``Closed``."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _fill(self, deadline: float) -> None:
        """Append at least one byte from the socket to ``self.buf``, or raise TimeoutError at ``deadline``."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            # Keep the socket's timeout unless it would overshoot the deadline, or is far shorter than
            # it (then recv would wake up needlessly): on the hot path no setsockopt is made.
            try:
                if not min(remaining, 1.0) / 2 <= self.rcvtimeo <= remaining + 0.05:
                    self._set_rcvtimeo(remaining)
                chunk = self.sock.recv(1 << 16)
            except BlockingIOError:
                continue  # SO_RCVTIMEO expired: look at the deadline again
            except (ConnectionResetError, OSError) as exc:
                raise Closed() from exc
            if not chunk:
                raise Closed()
            self.buf += chunk
            return

    def _set_rcvtimeo(self, seconds: float) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
        self.rcvtimeo = max(seconds, 0.001)

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
                raise TaskFailed(f"rank {self.rank}: the worker refused the connection: {body.get('message')}")
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


def _timeval(seconds: float) -> bytes:
    seconds = max(seconds, 0.001)
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))
