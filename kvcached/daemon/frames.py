"""A rank worker's frame server: the connections of the rank's task socket, apart from the tasks they carry.

It reads request frames (``kvcached.protocol.messages``), hands each whole one to an ``execute`` callback and queues the
reply that callback returns; it knows nothing of what a task does. Single-threaded, driven by the worker's selector.
Nothing a client does can end the worker or stall the others:

* every connection is non-blocking; replies queue in its output buffer, sent as the client reads them; one that stops
  reading stalls only itself: past ``OUT_CAP`` queued bytes its requests are not read until it drains;
* a request's bytes are buffered until the whole frame is there, at most ``MAX_PAYLOAD`` per frame. A frame larger than
  a read must first reserve its length from ``INPUT_BUDGET``, and while that is spent such connections are not read;
  frames up to a read are buffered in the connections' ``inbuf``, and once those hold ``INPUT_BUDGET`` bytes,
  connections with part of a frame buffered are not read (their clients wait), and one with nothing buffered is read
  ``SPARE_READ`` bytes at a time. So clients holding frames half-sent cannot keep small tasks waiting, and buffered
  requests stay near ``2 * INPUT_BUDGET`` (plus ``SPARE_READ`` a connection) whatever clients do. A frame left half-sent
  for ``PARTIAL_IDLE_S`` closes its connection;
* at most ``max_connections`` connections (below the process's open-file limit). At the cap, the connection idle the
  longest (nothing buffered, no request for ``IDLE_EVICT_S``) is closed to make room (its client reconnects on its next
  task); with none idle, the newcomer is answered REFUSED ("capacity") and closed. Running out of descriptors (EMFILE)
  is met the same way, with a descriptor kept in reserve for it; a peer that is neither the daemon's user nor in its
  group is answered REFUSED ("access") before a byte of it is read;
* a malformed frame (bad magic, a payload over ``MAX_PAYLOAD``) is answered INVALID and closes that connection only;
* connections take turns, fair by the bytes their tasks move as well as by requests: a turn is at most ``RUN_BATCH``
  requests and ends after the task that brings its bytes to ``TURN_BYTES`` (a larger single task is a turn of its own);
  a request counts as at least ``REQUEST_BYTES`` (a lookup moves nothing). Whole requests wait in the ``backlog`` (their
  connection not read again until its turn); the worker's loop runs one turn per pass, round by round: a connection
  joins the round under way (``round``) if it has not had its turn in it (back from idle, or new), else the next one;
  the lowest round goes next, and within a round the connection whose last turn moved less, a new one last. So a task
  waits for the turn under way and at most one turn of each other connection, whether it pipelines large tasks, sends
  them one at a time or pipelines thousands of lookups, and a client back from idle with a small task goes before those
  that moved more. A connection's first turn ends the round under way for those that join after it, and none is accepted
  while ``ACCEPT_BATCH`` new ones wait for their first turns: a client opening a new connection (from a new process or
  not) per task takes no more turns than with one of its own per task in flight, and a storm of connections costs the
  others about ``ACCEPT_BATCH`` short turns at most;
* a connection whose client closed its sending side (``shutdown(SHUT_WR)``) keeps its turns until every request it sent
  has run and every reply has gone out; a reply that cannot be delivered (the client is gone, or stopped reading for
  ``PARTIAL_IDLE_S``) is logged with its task.

Over 500 lines: the input budget, the turns and each connection's life are one bookkeeping over the same connections;
split, each half would reach into the other's. The budget's is ``FrameServer``'s ``buffered``, ``reserved`` and
``starved`` (with each connection's ``need``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import os
import resource
import selectors
import socket
import time
from collections.abc import Callable
from typing import NamedTuple

from kvcached.access import Access, peer_of
from kvcached.logs import Logger
from kvcached.protocol.messages import MAX_PAYLOAD, REPLY, REQUEST, REQUEST_MAGIC, TASK_RESULT, Op, Status, reply
from kvcached.protocol.stats import StatsSlot

RECV_CHUNK = 1 << 20
#: Where a buffered request's payload starts in its client's ``inbuf`` (``Client.next_request``).
PAYLOAD_AT = REQUEST.size
#: Reply bytes a connection may have queued before its requests stop being read.
OUT_CAP = 4 << 20
#: Bytes of unfinished request frames held over all connections.
INPUT_BUDGET = 2 * MAX_PAYLOAD
#: What a connection with nothing buffered is read while the small frames' budget is spent.
SPARE_READ = 16 << 10
#: A frame left unfinished this long closes its connection.
PARTIAL_IDLE_S = 30.0
#: A connection this long without a request may be closed to make room for a new one at the cap.
IDLE_EVICT_S = 1.0
#: Descriptors kept free below the open-file limit (the worker's own files, the reserve).
FD_HEADROOM = 64
#: Connections accepted per wake-up of the listener, so that tasks keep being served.
ACCEPT_BATCH = 64
#: Requests of one connection run per turn.
RUN_BATCH = 64
#: Bytes moved (as the tasks' replies say) after which a connection's turn ends.
TURN_BYTES = 4 << 20
#: The least a request counts as in its connection's bytes moved: tasks moving nothing (a lookup, a refusal) take turns.
REQUEST_BYTES = TURN_BYTES // RUN_BATCH
#: Undelivered replies named by task in the log line of a connection closed with replies queued.
NAMED_LOST = 8


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """What a frame server holds at most, and how long it waits (the constants above by default)."""

    out_cap: int = OUT_CAP
    input_budget: int = INPUT_BUDGET
    recv_chunk: int = RECV_CHUNK
    partial_idle_s: float = PARTIAL_IDLE_S
    idle_evict_s: float = IDLE_EVICT_S
    run_batch: int = RUN_BATCH
    turn_bytes: int = TURN_BYTES


class Request(NamedTuple):
    op: int
    flags: int
    task_id: int
    payload: bytes


NO_REQUEST = Request(0, 0, 0, b"")


@dataclasses.dataclass(slots=True, eq=False)
class Client:
    """One client connection: its socket, unparsed and unsent bytes, and what it waits for. ``greeted`` is
    the executor's: set once the client's HELLO was accepted. Compared (and hashed) by identity."""

    sock: socket.socket
    inbuf: bytearray = dataclasses.field(default_factory=bytearray)
    outbuf: bytearray = dataclasses.field(default_factory=bytearray)
    greeted: bool = False
    frame: bytearray | None = None  # its unfinished large frame's payload, filled in place (reserved whole)
    frame_header: Request = NO_REQUEST  # that frame's header (payload empty)
    filled: int = 0
    need: int = 0  # the length of a large frame waiting for room in the budget (0: any room below it)
    partial_since: float = 0.0  # when the unfinished frame in inbuf started (0: none)
    events: int = 0  # what the selector watches now
    active: float = dataclasses.field(default_factory=time.monotonic)  # when it last sent a request
    eof: bool = False  # the client closed its sending side: no more requests come
    round: int = 0  # the round it waits for in the backlog (see the module docstring)
    served: int = -1  # the round of its last turn (-1: none yet: last in its round, and its first ends it)
    moved: int = 0  # bytes its last turn moved (as counted): within a round, the smaller goes first
    #: (task id, end of its reply in all the bytes queued so far) of each reply not wholly sent yet.
    unsent: collections.deque[tuple[int, int]] = dataclasses.field(default_factory=collections.deque)
    queued: int = 0  # reply bytes queued since the connection opened
    sent: int = 0  # of which sent

    def next_request(self) -> tuple[int, int] | None:
        """``(op, payload length)`` of the whole request buffered after the one being run, its payload left at
        ``inbuf[PAYLOAD_AT : PAYLOAD_AT + length]`` (None: none yet, or a large frame, not looked at ahead)."""
        if self.frame is not None or len(self.inbuf) < REQUEST.size:
            return None
        magic, op, _, _, length = REQUEST.unpack_from(self.inbuf)
        if magic != REQUEST_MAGIC or len(self.inbuf) < REQUEST.size + length:
            return None
        return op, length


#: Runs one request of ``client`` and returns its reply frame (never raises for a bad task: it answers).
Execute = Callable[[Client, Request], bytes]


class FrameServer:
    """Serves the connections of one listening socket. The selector's data for each socket it registers is
    a callable taking the ready events: the worker's loop calls it."""

    def __init__(
        self,
        *,
        listener: socket.socket,
        selector: selectors.BaseSelector,
        execute: Execute,
        stats: StatsSlot,
        log: Logger,
        who: str,
        access: Access | None = None,
        max_connections: int | None = None,
        limits: Limits = Limits(),
    ) -> None:
        self.listener = listener
        self.limits = limits
        self.selector = selector
        self.execute = execute
        self.stats = stats
        self.log = log
        self.who = who  # names this server in refusals: "the worker of rank 3"
        self.access = access or Access.for_daemon(None)
        self.conns: dict[int, Client] = {}
        self.buffered = 0  # bytes in every connection's inbuf (large frames are not: they are reserved)
        self.reserved = 0  # bytes of INPUT_BUDGET reserved by the large frames being filled in place
        self.starved: set[Client] = set()  # connections not read until the budget has room for their need
        #: Connections with whole requests waiting for their turn, in the order they joined (an ordered set).
        self.backlog: dict[Client, None] = {}
        self.round = 0  # the round under way
        self.scratch = memoryview(bytearray(self.limits.recv_chunk))  # reused by every read: no allocation per message
        self.max_connections = max_connections or connection_limit()
        self.reserve_fd: int | None = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)

    def listen(self) -> None:
        self.selector.register(self.listener, selectors.EVENT_READ, lambda _events: self.accept())

    def stop_listening(self) -> None:
        """Close the listener: the kernel refuses new clients (they try the next daemon); open ones are served on."""
        with contextlib.suppress(KeyError, ValueError):  # not listening, or closed already
            self.selector.unregister(self.listener)
        self.listener.close()

    def accept(self) -> None:
        """Accept what is waiting on the listener, ``ACCEPT_BATCH`` at most, less the new connections waiting
        for their first turns (a storm waits in the kernel's queue: see the module docstring)."""
        for _ in range(ACCEPT_BATCH - sum(client.served < 0 for client in self.backlog)):
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE) or self.reserve_fd is None:
                    return
                self._refuse_with_reserve()
                continue
            if len(self.conns) >= self.max_connections and not self._evict_idle():
                self._refuse(sock, "capacity", f"{self.who} has {len(self.conns)} connections open")
                continue
            if self._allowed(sock):
                self.serve(sock)

    def serve(self, sock: socket.socket) -> Client:
        """Serve ``sock``, a connected client (accepted here, its peer allowed; or one end of a socket pair)."""
        sock.setblocking(False)
        client = Client(sock)
        self.conns[sock.fileno()] = client
        self._watch(client)
        self.stats.count(connections=1)
        return client

    def _allowed(self, sock: socket.socket) -> bool:
        """Whether the peer may use the instance; if not, it is refused and logged."""
        peer = peer_of(sock)
        if self.access.allows(peer):
            return True
        self.log.warning(
            "refused connection: peer is neither the daemon's user nor in its group",
            peer_pid=peer.pid,
            peer_uid=peer.uid,
            peer_gids=sorted(peer.gids),
            allowed_uid=self.access.uid,
            allowed_gid=self.access.gid,
        )
        why = f"uid {peer.uid} is neither the daemon's user (uid {self.access.uid}) nor in its group"
        self._refuse(sock, "access", why)
        return False

    def _evict_idle(self) -> bool:
        """Close the connection idle the longest (nothing buffered, a large frame included), if that is
        ``IDLE_EVICT_S`` or more; whether one was."""
        idle = [c for c in self.conns.values() if not c.inbuf and not c.outbuf and c.frame is None]
        oldest = min(idle, key=lambda c: c.active, default=None)
        if oldest is None or time.monotonic() - oldest.active < self.limits.idle_evict_s:
            return False
        self.close(oldest.sock)
        return True

    def _refuse(self, sock: socket.socket, reason: str, why: str) -> None:
        self.stats.count(tasks_refused=1)
        with contextlib.suppress(OSError):
            sock.send(reply(Op.HELLO, Status.REFUSED, 0, {"message": why, "reason": reason}), socket.MSG_DONTWAIT)
        sock.close()

    def _refuse_with_reserve(self) -> None:
        """Out of descriptors: give up the reserve one to accept and refuse the waiting client, then take it
        back (otherwise the client would sit in the backlog, and the listener would wake us forever)."""
        assert self.reserve_fd is not None
        os.close(self.reserve_fd)
        self.reserve_fd = None
        with contextlib.suppress(OSError):
            sock, _ = self.listener.accept()
            self._refuse(sock, "capacity", f"{self.who} is out of file descriptors")
        with contextlib.suppress(OSError):
            self.reserve_fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)

    def _watch(self, client: Client) -> None:
        """Point the selector at what ``client`` waits for now."""
        readable = len(client.outbuf) <= self.limits.out_cap and not client.eof and client not in self.starved
        events = selectors.EVENT_READ if readable and client not in self.backlog else 0
        if client.outbuf:
            events |= selectors.EVENT_WRITE
        if events == client.events:
            return
        if client.events == 0:
            self.selector.register(client.sock, events, lambda ready: self.on_event(client.sock, ready))
        elif events == 0:
            self.selector.unregister(client.sock)
        else:
            self.selector.modify(client.sock, events, lambda ready: self.on_event(client.sock, ready))
        client.events = events

    def close(self, sock: socket.socket) -> None:
        """Forget and close a connection (logging the replies it leaves undelivered, by task)."""
        client = self.conns.pop(sock.fileno(), None)
        if client is not None:
            if client.unsent:
                lost = [task_id for task_id, _ in client.unsent]
                self.log.warning(
                    "replies not delivered: the connection closed",
                    replies=len(lost),
                    tasks=lost[:NAMED_LOST],
                    client_closed=client.eof,
                )
            if client.events:
                self.selector.unregister(sock)
            self.buffered -= len(client.inbuf)
            self.reserved -= len(client.frame) if client.frame is not None else 0
            self.starved.discard(client)
            self.backlog.pop(client, None)
            self._feed_starved()
        sock.close()

    def on_event(self, sock: socket.socket, events: int) -> None:
        client = self.conns.get(sock.fileno())
        if client is None:
            return
        if events & selectors.EVENT_WRITE:
            if not self._flush(client):
                self.close(sock)
                return
            if len(client.outbuf) <= self.limits.out_cap and _whole_request(client):
                self._wait_turn(client)  # its replies drained: the requests it sent meanwhile run
        if (events & selectors.EVENT_READ and not self._on_readable(client)) or self._finished(client):
            self.close(sock)
            return
        self._watch(client)

    def _finished(self, client: Client) -> bool:
        """Whether a connection whose client sent its last request has nothing left: every whole request run,
        every reply sent (a frame it left unfinished can never run, and is logged)."""
        if not client.eof or client.outbuf or _whole_request(client) or client in self.backlog:
            return False
        if client.inbuf or client.frame is not None:
            self.log.warning("a client closed its connection with a frame unfinished: it was not run")
        return True

    def sending(self) -> bool:
        return any(client.outbuf for client in self.conns.values())

    def flush_all(self, seconds: float) -> None:
        """Send every queued reply, waiting at most ``seconds`` in all (before a handover's exit: a task that
        ran is answered; one whose connection closes unanswered did not run)."""
        deadline = time.monotonic() + seconds
        for client in list(self.conns.values()):
            if client.outbuf:
                with contextlib.suppress(OSError):
                    client.sock.settimeout(max(0.001, deadline - time.monotonic()))
                    client.sock.sendall(client.outbuf)
                    client.outbuf.clear()
                    client.unsent.clear()

    def tick(self, now: float) -> None:
        """Close connections stalled ``PARTIAL_IDLE_S`` on an unfinished frame or on replies left unread."""
        limit = self.limits.partial_idle_s
        stalled = [c for c in self.conns.values() if c.partial_since and now - c.partial_since > limit]
        for client in stalled:
            why = "stopped reading its replies" if _whole_request(client) else "left a frame unfinished"
            self.log.warning(f"closing a connection that {why}", seconds=round(now - client.partial_since))
            self.close(client.sock)

    def _on_readable(self, client: Client) -> bool:
        """Read what arrived, under the input budget, and run every complete request; False when the connection should
        close."""
        spent = self.buffered >= self.limits.input_budget
        if client.frame is None and spent and client.inbuf:
            self.starved.add(client)  # others hold the budget: wait for it instead of growing without bound
            return True
        # A large frame is read straight into its own buffer, allocated once at its reserved length.
        target = memoryview(client.frame)[client.filled :] if client.frame is not None else self.scratch
        if spent and client.frame is None:
            target = target[:SPARE_READ]  # nothing buffered yet: a small task still gets in
        try:
            got = client.sock.recv_into(target)
        except BlockingIOError:
            return True
        except OSError:
            got = 0
        if not got:  # end of input: what it sent still runs, and its replies go out (``_finished``)
            client.eof = True
            return self._wait_turn(client)
        client.active = time.monotonic()
        if client.frame is not None:
            client.filled += got
        else:
            client.inbuf += self.scratch[:got]
            self.buffered += got
        # A whole request waits for its turn; otherwise a large frame's header reserves its length.
        return self._wait_turn(client) if _whole_request(client) else self._turn(client)

    def _wait_turn(self, client: Client) -> bool:
        if _whole_request(client) and client not in self.backlog:
            client.round = self.round + 1 if client.served >= self.round else self.round
            self.backlog[client] = None
        return True

    def _turn(self, client: Client) -> bool:
        """Run the requests of ``client``'s turn, send what the socket takes; False when it should close."""
        ok = self._run_frames(client)
        pending = client.inbuf or client.frame is not None
        client.partial_since = (client.partial_since or time.monotonic()) if pending else 0.0
        self._feed_starved()
        return ok and self._flush(client)

    def run_backlog(self) -> None:
        """Run the backlog's next turn (the worker's loop calls it after each round of selector events, not waiting
        while ``backlog`` holds one: requests arriving meanwhile are read, and placed, before the next turn)."""
        while self.backlog:
            client = min(self.backlog, key=lambda c: (c.round, c.served < 0, c.moved))
            self.backlog.pop(client, None)
            if self.conns.get(client.sock.fileno()) is not client:
                continue  # closed meanwhile
            first = client.served < 0
            self.round = client.served = max(self.round, client.round)
            client.moved = 0
            ok = self._turn(client)  # (which puts it back in the backlog if it has more)
            if first:  # those waiting go before the next new connection
                self.round = max(self.round, client.served + 1)
            if not ok or self._finished(client):
                self.close(client.sock)
            else:
                self._watch(client)
            return

    def _run_frames(self, client: Client) -> bool:
        """Run the whole frames buffered, a turn at most (``run_batch`` requests, ``turn_bytes`` moved: more left, the
        connection joins the ``backlog``); False when the connection should close (a malformed frame)."""
        before = client.moved
        for _ in range(self.limits.run_batch):
            if client.moved - before >= self.limits.turn_bytes:
                break
            if client.frame is not None:  # a large frame, filled in place: run, its reservation returned to the budget
                if client.filled < len(client.frame):
                    return True
                payload = bytes(client.frame)
                client.frame, client.filled = None, 0
                self.reserved -= len(payload)
                if not self._run(client, client.frame_header._replace(payload=payload)):
                    return True
                continue
            if len(client.inbuf) < REQUEST.size:
                return True
            magic, op, flags, task_id, length = REQUEST.unpack_from(client.inbuf)
            if magic != REQUEST_MAGIC or length > MAX_PAYLOAD:  # not one of ours: answered INVALID, then closed
                why = (
                    "bad frame magic"
                    if magic != REQUEST_MAGIC
                    else f"payload of {length} bytes exceeds the limit of {MAX_PAYLOAD} bytes per task: split it"
                )
                self._queue(client, reply(op, Status.INVALID, task_id, {"field": "frame", "message": why}))
                self.stats.count(tasks_refused=1)
                self._flush(client)
                return False
            if len(client.inbuf) >= REQUEST.size + length:
                payload = bytes(client.inbuf[REQUEST.size : REQUEST.size + length])
                del client.inbuf[: REQUEST.size + length]
                self.buffered -= REQUEST.size + length
                if not self._run(client, Request(op, flags, task_id, payload)):
                    return True
                continue
            if length > self.limits.recv_chunk:  # a large frame: reserve its whole length, or wait for room
                self._reserve(client, Request(op, flags, task_id, b""), length)
            return True
        return self._wait_turn(client)

    def _reserve(self, client: Client, header: Request, length: int) -> None:
        """Give a large frame its own buffer of ``length`` bytes from the budget, or starve its connection
        until the budget has room."""
        if self.reserved + length > self.limits.input_budget:
            client.need = length
            self.starved.add(client)
            return
        client.need = 0
        self.reserved += length
        client.frame, client.frame_header = bytearray(length), header
        have = len(client.inbuf) - REQUEST.size
        client.frame[:have] = client.inbuf[REQUEST.size :]
        client.filled = have
        self.buffered -= len(client.inbuf)
        client.inbuf.clear()

    def _run(self, client: Client, request: Request) -> bool:
        """Execute one request and queue its reply; False when the client stopped reading its replies (then
        its requests are not taken until it does)."""
        client.partial_since = 0.0
        answer = self.execute(client, request)
        self._queue(client, answer)
        _, op, status, _, length = REPLY.unpack_from(answer)
        moved = 0
        if status == Status.OK and op != Op.HELLO and length == TASK_RESULT.size:
            moved = TASK_RESULT.unpack_from(answer, REPLY.size)[1]
        client.moved += max(moved, REQUEST_BYTES)
        return len(client.outbuf) <= self.limits.out_cap

    @staticmethod
    def _queue(client: Client, answer: bytes) -> None:
        """Queue one reply frame for ``client``, remembering its task until it is wholly sent."""
        client.outbuf += answer
        client.queued += len(answer)
        client.unsent.append((REPLY.unpack_from(answer)[3], client.queued))

    def _flush(self, client: Client) -> bool:
        """Send what the socket takes now; False when the client is gone."""
        while client.outbuf:
            try:
                sent = client.sock.send(client.outbuf)
            except BlockingIOError:
                return True
            except OSError:  # the client left: its replies are lost (``close`` logs them), the rank serves on
                return False
            del client.outbuf[:sent]
            client.sent += sent
            while client.unsent and client.unsent[0][1] <= client.sent:
                client.unsent.popleft()
        return True

    def _feed_starved(self) -> None:
        """Read again from starved connections once the budget has room for what each waits for."""
        for client in list(self.starved):
            if client.sock.fileno() < 0:  # closed meanwhile
                self.starved.discard(client)
                continue
            budget = self.limits.input_budget
            room = self.reserved + client.need <= budget if client.need else self.buffered < budget
            if room:
                self.starved.discard(client)
                self._watch(client)


def _whole_request(client: Client) -> bool:
    if client.frame is not None:
        return client.filled == len(client.frame)
    if len(client.inbuf) < REQUEST.size:
        return False
    length: int = REQUEST.unpack_from(client.inbuf)[4]
    return len(client.inbuf) >= REQUEST.size + length


def connection_limit() -> int:
    """Connections a worker accepts: what its open-file limit leaves after ``FD_HEADROOM``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = 1 << 16 if soft == resource.RLIM_INFINITY else soft
    return max(8, min(1 << 16, limit - FD_HEADROOM))
