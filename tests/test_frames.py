"""The frame server in-process, over socket pairs: frames in, the ``execute`` callback's replies out, and
the input budget and caps that keep one client from costing the others (``kvcached.daemon.frames``).

No daemon: a real ``FrameServer`` on a real selector, real Unix sockets, an ``execute`` that echoes. The
limits are small (``Limits``) so that a frame "larger than a read" is kilobytes, not megabytes; the
arithmetic is the same at the worker's sizes.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import structlog.testing

from kvcached import logs
from kvcached.access import Access
from kvcached.daemon.frames import ACCEPT_BATCH, RUN_BATCH, Client, FrameServer, Limits, Request
from kvcached.protocol.messages import (
    MAX_PAYLOAD,
    REPLY,
    REQUEST,
    REQUEST_MAGIC,
    TASK_RESULT,
    Op,
    Status,
    pack_ids,
    reply,
    request,
)
from kvcached.protocol.names import task_socket_path
from kvcached.protocol.stats import STATS_SIZE, StatsSlot
from kvcached.status import read_status
from tests.conftest import DaemonFactory

LIMITS = Limits(out_cap=64 << 10, input_budget=256 << 10, recv_chunk=16 << 10, partial_idle_s=30.0, idle_evict_s=0.2)


class Harness:
    """A frame server whose ``execute`` records each request and answers OK with its payload."""

    def __init__(self, listener: socket.socket | None = None, **options: object) -> None:
        self.selector = selectors.DefaultSelector()
        self.stats = StatsSlot(memoryview(bytearray(STATS_SIZE)).cast("Q"))
        self.seen: list[Request] = []
        self.server = FrameServer(
            listener=listener or socket.socket(socket.AF_UNIX, socket.SOCK_STREAM),
            selector=self.selector,
            execute=self.execute,
            stats=self.stats,
            log=logs.get("test.frames"),
            who="the test server",
            **{"limits": LIMITS, **options},  # type: ignore[arg-type]
        )

    def execute(self, client: Client, req: Request) -> bytes:
        self.seen.append(req)
        return reply(req.op, Status.OK, req.task_id, req.payload)

    def connect(self) -> socket.socket:
        """A client socket whose other end the server serves."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.serve(ours)
        theirs.settimeout(5)
        return theirs

    def pump(self, rounds: int = 200) -> None:
        """Let the server handle what is ready, until nothing is (as the worker's loop does)."""
        for _ in range(rounds):
            events = self.selector.select(timeout=0)
            if not events and not self.server.backlog:
                return
            for key, mask in events:
                key.data(mask)
            self.server.run_backlog()

    def counters(self) -> dict[str, int]:
        return self.stats.counters()


def read_reply(sock: socket.socket) -> tuple[int, int, int, bytes]:
    """(op, status, task id, payload) of the next reply on ``sock``."""
    head = _exactly(sock, REPLY.size)
    _magic, op, status, task_id, length = REPLY.unpack(head)
    return op, status, task_id, _exactly(sock, length)


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the server closed the connection"
        data += chunk
    return data


def closed(sock: socket.socket) -> bool:
    sock.settimeout(1)
    try:
        while sock.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    return True


@pytest.fixture
def harness() -> Iterator[Harness]:
    h = Harness()
    yield h
    for client in list(h.server.conns.values()):
        h.server.close(client.sock)


def test_a_whole_frame_is_executed_and_answered(harness: Harness) -> None:
    """A request frame reaches ``execute`` whole (op, flags, task id, payload); its reply goes back."""
    client = harness.connect()
    client.sendall(request(Op.SWAP_OUT, 7, b"ids", flags=1))
    harness.pump()
    assert harness.seen == [Request(Op.SWAP_OUT, 1, 7, b"ids")]
    assert read_reply(client) == (Op.SWAP_OUT, Status.OK, 7, b"ids")
    assert harness.counters()["connections"] == 1


def test_frames_sent_byte_by_byte_or_pipelined_run_in_order(harness: Harness) -> None:
    """A frame that arrives a byte at a time runs once it is whole; frames sent back to back run in
    order, each answered in order."""
    client = harness.connect()
    frame = request(Op.LOOKUP, 1, b"k" * 40)
    for byte in frame:
        assert not harness.seen
        client.send(bytes([byte]))
        harness.pump()
    assert [r.task_id for r in harness.seen] == [1]
    client.sendall(b"".join(request(Op.SWAP_IN, n, n.to_bytes(4, "little")) for n in range(2, 50)))
    harness.pump()
    assert [r.task_id for r in harness.seen] == list(range(1, 50))
    assert [read_reply(client)[2] for _ in range(49)] == list(range(1, 50))


@pytest.mark.parametrize("bad", ["magic", "length"])
def test_a_malformed_frame_is_answered_invalid_and_closes_only_its_connection(harness: Harness, bad: str) -> None:
    """A bad magic, or a payload over MAX_PAYLOAD: INVALID naming the frame, that connection closed, the
    other served; nothing executed."""
    client, other = harness.connect(), harness.connect()
    magic, length = (b"XXXX", 4) if bad == "magic" else (REQUEST_MAGIC, MAX_PAYLOAD + 1)
    client.sendall(REQUEST.pack(magic, Op.SWAP_OUT, 0, 3, length) + b"abcd")
    harness.pump()
    _op, status, task_id, body = read_reply(client)
    assert (status, task_id, json.loads(body)["field"]) == (Status.INVALID, 3, "frame")
    assert closed(client) and len(harness.server.conns) == 1
    assert harness.seen == [] and harness.counters()["tasks_refused"] == 1
    other.sendall(request(Op.HELLO, 9, b"{}"))
    harness.pump()
    assert read_reply(other)[2] == 9


def test_a_client_that_never_reads_stops_being_read_and_stalls_only_itself(harness: Harness) -> None:
    """Past ``out_cap`` queued reply bytes the server stops reading a client's requests (they wait in its
    socket), serves another client meanwhile, and reads again once the first drains its replies."""
    hog, other = harness.connect(), harness.connect()
    hog.setblocking(False)
    payload = b"p" * 4096
    count = 300  # replies of 1.2 MiB: far past out_cap and what the socket holds
    stream = b"".join(request(Op.SWAP_OUT, task_id, payload) for task_id in range(count))
    sent = 0
    for _ in range(count):  # the hog sends all it can and reads nothing
        with contextlib.suppress(BlockingIOError):
            sent += hog.send(stream[sent:])
        harness.pump()
    assert len(harness.seen) < count, "every request was taken although the client reads nothing"
    queued = next(c for c in harness.server.conns.values() if c.outbuf)
    assert len(queued.outbuf) > LIMITS.out_cap and not queued.events & selectors.EVENT_READ
    other.sendall(request(Op.SWAP_IN, 10**6, b"x"))
    harness.pump()
    assert harness.seen[-1].task_id == 10**6 and read_reply(other)[2] == 10**6
    received = bytearray()  # now the hog reads: every request it sends is taken and answered, in order
    size = REPLY.size + len(payload)
    deadline = time.monotonic() + 30
    while len(received) < count * size and time.monotonic() < deadline:
        with contextlib.suppress(BlockingIOError):
            sent += hog.send(stream[sent:]) if sent < len(stream) else 0
        with contextlib.suppress(BlockingIOError):
            received += hog.recv(1 << 20)
        harness.pump()
    ids = [REPLY.unpack_from(received, n * size)[3] for n in range(count)]
    assert ids == list(range(count)) and len(harness.seen) == count + 1


def test_connections_take_turns_and_a_pipelined_flood_waits_behind_the_others(harness: Harness) -> None:
    """A client that pipelined 1,000 requests has ``run_batch`` of them run per turn: another client's
    request, sent after the flood was read, runs after a few turns of it, not after all of it (it waited
    behind every request a flooder had sent: 15 s behind 300 such clients); the flood runs whole and in
    order with nothing more sent, and its replies all come."""
    flood, other = harness.connect(), harness.connect()
    count = 1000
    flood.sendall(b"".join(request(Op.LOOKUP, task_id, b"k") for task_id in range(count)))
    harness.pump(rounds=1)
    assert 0 < len(harness.seen) <= 2 * LIMITS.run_batch, len(harness.seen)
    other.sendall(request(Op.SWAP_IN, 10**6, b"x"))
    harness.pump()
    order = [r.task_id for r in harness.seen]
    assert order.index(10**6) <= 4 * LIMITS.run_batch, order.index(10**6)
    assert [t for t in order if t != 10**6] == list(range(count))
    assert read_reply(other)[2] == 10**6
    assert [read_reply(flood)[2] for _ in range(count)] == list(range(count))


def test_requests_left_buffered_behind_a_full_output_run_once_the_client_reads(harness: Harness) -> None:
    """A client whose replies filled ``out_cap`` while more of its requests lay buffered, all of them sent:
    once it reads its replies, the buffered ones run and are answered without it sending anything more."""
    client = harness.connect()
    (served,) = harness.server.conns.values()
    served.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # replies pile up in its outbuf
    payload = b"p" * 512
    count = 300  # 160 KiB of replies: past out_cap (64 KiB); the requests fit the input budget
    client.sendall(b"".join(request(Op.SWAP_OUT, task_id, payload) for task_id in range(count)))
    harness.pump()
    assert len(harness.seen) < count, "every request ran although the replies were not read"
    client.setblocking(False)
    received, size = bytearray(), REPLY.size + len(payload)
    deadline = time.monotonic() + 30
    while len(received) < count * size and time.monotonic() < deadline:
        with contextlib.suppress(BlockingIOError):
            received += client.recv(1 << 20)
        harness.pump()
    assert [REPLY.unpack_from(received, n * size)[3] for n in range(len(received) // size)] == list(range(count))


def test_large_frames_reserve_the_input_budget_and_wait_for_room(harness: Harness) -> None:
    """A frame larger than a read reserves its whole length; one that does not fit in what is left waits
    (its connection is not read) until the first completes; afterwards nothing stays reserved."""
    first, second = harness.connect(), harness.connect()
    big = 200 << 10  # more than a read, less than the budget; two of them exceed it
    first.sendall(REQUEST.pack(REQUEST_MAGIC, Op.STORE, 0, 1, big) + b"a" * (16 << 10))
    harness.pump()
    assert harness.server.reserved == big
    second.sendall(REQUEST.pack(REQUEST_MAGIC, Op.STORE, 0, 2, big) + b"b" * 1024)
    harness.pump()
    waiting = list(harness.server.starved)
    assert len(waiting) == 1 and waiting[0].need == big and harness.server.reserved == big
    first.sendall(b"a" * (big - (16 << 10)))
    harness.pump()
    assert [r.task_id for r in harness.seen] == [1] and len(harness.seen[0].payload) == big
    assert harness.server.reserved == 0 and not harness.server.starved  # the second is read again
    second.sendall(b"b" * (big - 1024))
    harness.pump()
    assert [r.task_id for r in harness.seen] == [1, 2] and harness.seen[1].payload == b"b" * big
    assert (harness.server.reserved, harness.server.buffered) == (0, 0)


def test_large_frames_left_half_sent_keep_no_small_task_waiting(harness: Harness) -> None:
    """Clients holding the whole reserve of large frames half-sent (and a third waiting for room) do not stop
    another client's small task: small frames are buffered apart from the large ones' reserve."""
    big = 125 << 10  # two of them take the budget's reserve, a third waits
    holders = [harness.connect() for _ in range(3)]
    for n, sock in enumerate(holders):
        sock.sendall(REQUEST.pack(REQUEST_MAGIC, Op.STORE, 0, n, big) + b"h" * (big - 1))
        harness.pump()
    assert harness.server.reserved == 2 * big and len(harness.server.starved) == 1
    victim = harness.connect()
    victim.sendall(request(Op.SWAP_OUT, 7, b"small"))
    harness.pump()
    assert read_reply(victim)[2:] == (7, b"small") and [r.task_id for r in harness.seen] == [7]


def test_small_frames_left_half_sent_keep_no_small_task_waiting(harness: Harness) -> None:
    """Clients each holding a small frame (under a read) half-sent spend the whole budget of small frames: a
    connection with nothing buffered is still read (``SPARE_READ``), so another client's small task runs; the
    holders are not read again until there is room."""
    holders = [harness.connect() for _ in range(20)]
    for n, sock in enumerate(holders):
        sock.sendall(request(Op.SWAP_OUT, n, b"h" * (15 << 10))[:-8])
        harness.pump()
    assert harness.server.buffered >= LIMITS.input_budget and harness.server.starved == set()
    holders[0].sendall(b"more")
    harness.pump()
    assert len(harness.server.starved) == 1  # part of a frame buffered: it waits for room
    victim = harness.connect()
    victim.sendall(request(Op.SWAP_OUT, 99, b"small"))
    harness.pump()
    assert read_reply(victim)[2:] == (99, b"small") and [r.task_id for r in harness.seen] == [99]


def test_closing_a_connection_mid_frame_returns_its_share_of_the_budget(harness: Harness) -> None:
    """A client that leaves halfway through a large frame, or a small one, gives back what it reserved and
    buffered."""
    client, small = harness.connect(), harness.connect()
    client.sendall(REQUEST.pack(REQUEST_MAGIC, Op.STORE, 0, 1, 100 << 10) + b"a" * (30 << 10))
    small.sendall(request(Op.SWAP_OUT, 2, b"x" * 1000)[:-10])
    harness.pump()
    assert harness.server.reserved == 100 << 10 and harness.server.buffered == REQUEST.size + 990
    client.close()
    small.close()
    harness.pump()
    assert (harness.server.reserved, harness.server.buffered, len(harness.server.conns)) == (0, 0, 0)
    assert harness.seen == []


def test_a_frame_left_unfinished_closes_its_connection_after_the_idle_limit(harness: Harness) -> None:
    """A connection whose frame stalls half-sent is closed at the first tick past ``partial_idle_s``;
    a quiet connection with nothing half-sent is not."""
    stalled, quiet = harness.connect(), harness.connect()
    stalled.sendall(request(Op.SWAP_OUT, 1, b"12345678")[:-3])
    harness.pump()
    harness.server.tick(time.monotonic() + LIMITS.partial_idle_s / 2)
    assert len(harness.server.conns) == 2
    harness.server.tick(time.monotonic() + LIMITS.partial_idle_s + 1)
    assert len(harness.server.conns) == 1 and closed(stalled)
    quiet.sendall(request(Op.HELLO, 2, b"{}"))
    harness.pump()
    assert read_reply(quiet)[2] == 2


def test_flush_all_sends_every_queued_reply() -> None:
    """Before a handover's exit, ``flush_all`` sends what is still queued for a client (``sending`` says
    whether anything is), waiting for it to read."""
    h = Harness(limits=Limits(out_cap=4 << 20))
    client = h.connect()
    client.setblocking(False)
    pending = b"".join(request(Op.SWAP_OUT, task_id, b"x" * 100_000) for task_id in range(8))
    while pending:  # the replies outgrow what the socket holds: the rest queues in the server
        with contextlib.suppress(BlockingIOError):
            pending = pending[client.send(pending) :]
        h.pump()
    assert len(h.seen) == 8 and h.server.sending()
    client.setblocking(True)
    client.settimeout(5)
    got: list[int] = []
    reader = threading.Thread(target=lambda: got.extend(read_reply(client)[2] for _ in range(8)))
    reader.start()
    h.server.flush_all(5.0)
    reader.join(5)
    assert got == list(range(8)) and not h.server.sending()


def _listening(tmp_path: Path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "frames.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    listener.setblocking(False)
    return listener, path


def _dial(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(path)
    return sock


def _dial_from_a_child(path: str) -> socket.socket:
    """A connection made by a child process that hands it over and exits: its peer is a process of its own."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            sock = _dial(path)
            socket.send_fds(theirs, [b"x"], [sock.fileno()])
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    ours.settimeout(5)
    _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    ours.close(), theirs.close()
    sock = socket.socket(fileno=fds[0])
    sock.settimeout(5)
    return sock


def test_at_the_connection_cap_an_idle_connection_makes_room_else_the_newcomer_is_refused(tmp_path: Path) -> None:
    """At ``max_connections`` the connection idle the longest (past ``idle_evict_s``) is closed for a
    newcomer; with none idle that long, the newcomer is answered REFUSED ("capacity") and closed."""
    listener, path = _listening(tmp_path)
    h = Harness(listener, max_connections=2)
    h.server.listen()
    try:
        first, second = _dial(path), _dial(path)
        h.pump()
        assert len(h.server.conns) == 2
        refused = _dial(path)
        h.pump()
        op, status, _, body = read_reply(refused)
        assert (op, status, json.loads(body)["reason"]) == (Op.HELLO, Status.REFUSED, "capacity")
        time.sleep(LIMITS.idle_evict_s + 0.05)
        second.sendall(request(Op.HELLO, 1, b"{}"))  # busy again: the first is now the idlest
        h.pump()
        newcomer = _dial(path)
        h.pump()
        assert len(h.server.conns) == 2 and closed(first)
        newcomer.sendall(request(Op.HELLO, 5, b"{}"))
        h.pump()
        assert read_reply(newcomer)[2] == 5 and h.counters()["tasks_refused"] == 1
    finally:
        h.server.stop_listening()


@pytest.mark.parametrize("sent", ["half", "whole"])
def test_at_the_cap_a_connection_holding_a_large_frame_is_not_evicted(tmp_path: Path, sent: str) -> None:
    """A connection whose large frame is half-sent, or whole and waiting for its turn (its bytes are in the
    frame's own buffer, not ``inbuf``), is not idle: past ``idle_evict_s`` at the cap a newcomer is refused, and
    the frame's task still runs."""
    listener, path = _listening(tmp_path)
    h = Harness(listener, max_connections=1)
    h.server.listen()
    try:
        holder = _dial(path)
        h.pump()
        frame = request(Op.SWAP_OUT, 7, b"l" * (100 << 10))  # larger than a read: a large frame
        holder.sendall(frame[: len(frame) // 2] if sent == "half" else frame)
        for _ in range(20):  # read it, without running the turns
            for key, mask in h.selector.select(timeout=0.01):
                key.data(mask)
        time.sleep(LIMITS.idle_evict_s + 0.05)
        refused = _dial(path)
        for _ in range(5):
            for key, mask in h.selector.select(timeout=0.02):
                key.data(mask)
        assert read_reply(refused)[1] == Status.REFUSED
        if sent == "half":
            holder.sendall(frame[len(frame) // 2 :])
        h.pump()
        assert read_reply(holder)[2] == 7
    finally:
        h.server.stop_listening()


def test_a_peer_outside_the_daemons_user_and_group_is_refused_before_a_byte_is_read(tmp_path: Path) -> None:
    """A connection from a uid the access policy does not admit is answered REFUSED ("access") and closed;
    nothing it sent is executed."""
    listener, path = _listening(tmp_path)
    stranger_policy = Access(uid=65_000, gid=65_000)  # neither this process's uid nor a group of it
    h = Harness(listener, access=stranger_policy)
    h.server.listen()
    try:
        client = _dial(path)
        client.sendall(request(Op.HELLO, 1, b"{}"))
        h.pump()
        _, status, _, body = read_reply(client)
        assert (status, json.loads(body)["reason"]) == (Status.REFUSED, "access")
        assert closed(client) and h.seen == [] and not h.server.conns
    finally:
        h.server.stop_listening()


def test_stop_listening_refuses_newcomers_and_serves_those_connected(tmp_path: Path) -> None:
    """A handover's drain: once the listener is closed a new connection is refused by the kernel, and a
    connection already open is still answered."""
    listener, path = _listening(tmp_path)
    h = Harness(listener)
    h.server.listen()
    connected = _dial(path)
    h.pump()
    h.server.stop_listening()
    with pytest.raises((ConnectionRefusedError, FileNotFoundError)):
        _dial(path)
    connected.sendall(request(Op.SWAP_OUT, 4, b"x"))
    h.pump()
    assert read_reply(connected)[2] == 4


def test_a_half_closed_connection_gets_every_reply_of_what_it_sent(harness: Harness) -> None:
    """A client sends 5,000 requests, closes its sending side and reads until the end: all 5,000 replies come,
    in order, although most were queued behind replies it had not read yet; then the connection closes."""
    client = harness.connect()
    (served,) = harness.server.conns.values()
    served.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    count = 5000

    def send_then_half_close() -> None:
        client.sendall(b"".join(request(Op.LOOKUP, task_id, b"k" * 32) for task_id in range(count)))
        client.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send_then_half_close, daemon=True)
    sender.start()
    received = bytearray()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        harness.pump(rounds=5)
        if not select.select([client], [], [], 0)[0]:
            continue
        chunk = client.recv(1 << 20)
        if not chunk:
            break
        received += chunk
    sender.join(10)
    size = REPLY.size + 32
    assert len(received) == count * size
    assert [REPLY.unpack_from(received, n * size)[3] for n in range(count)] == list(range(count))
    assert harness.server.conns == {}, "closed once everything it sent was answered"


def test_replies_a_client_never_takes_are_logged_by_task(harness: Harness) -> None:
    """A client that sends requests and closes its socket without reading: the replies that cannot be delivered
    are logged with their tasks, and the server serves on."""
    client = harness.connect()
    (served,) = harness.server.conns.values()
    served.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    client.sendall(b"".join(request(Op.LOOKUP, task_id, b"p" * 512) for task_id in range(200)))
    harness.pump()
    client.close()
    with structlog.testing.capture_logs() as logged:
        harness.pump()
    assert harness.server.conns == {}
    lost = next(line for line in logged if line["event"].startswith("replies not delivered"))
    ran = len(harness.seen)  # those whose replies fit the output cap; the rest were never taken
    assert lost["replies"] > 0 and lost["tasks"] == list(range(ran - lost["replies"], ran))[:8], lost
    other = harness.connect()
    other.sendall(request(Op.LOOKUP, 7, b"k"))
    harness.pump()
    assert read_reply(other)[2] == 7


class MovingHarness(Harness):
    """A frame server whose tasks report moving as many bytes as their payload says (a u64): the turns are
    ordered by what the tasks move."""

    def execute(self, client: Client, req: Request) -> bytes:
        self.seen.append(req)
        moved = int.from_bytes(req.payload[:8], "little")
        return reply(req.op, Status.OK, req.task_id, TASK_RESULT.pack(1, moved, 0))

    def wait_of(self, sock: socket.socket, task_id: int, moves: bytes, rounds: int = 50) -> int:
        """Send a task on ``sock`` and serve until its reply comes (``rounds`` passes at most): how many tasks
        ran before it."""
        before = len(self.seen)
        sock.sendall(request(Op.SWAP_OUT, task_id, moves))
        for _ in range(rounds):
            self.pump(rounds=1)
            if select.select([sock], [], [], 0)[0]:
                break
        assert read_reply(sock)[2] == task_id
        return [r.task_id for r in self.seen[before:]].index(task_id)


def test_a_client_pipelining_large_tasks_costs_another_at_most_one_turn() -> None:
    """Four clients pipeline tasks that each move 64 MiB; a fifth sends a small task now and then (after a round
    of theirs: it comes back from idle): once each has had a turn, each small task runs after at most one large
    task (the one under way), never behind a round of the four; the large ones take turns, one each, and all of
    them run."""
    harness = MovingHarness()
    heavy = [harness.connect() for _ in range(4)]
    light = harness.connect()
    large = (64 << 20).to_bytes(8, "little")
    for n, sock in enumerate(heavy):
        sock.sendall(b"".join(request(Op.SWAP_OUT, 1000 * n + i, large) for i in range(20)))
    harness.pump(rounds=3)
    waits = []
    for i in range(10):
        waits.append(harness.wait_of(light, 10**6 + i, (4096).to_bytes(8, "little")))
        harness.pump(rounds=5)  # a round of the large tasks between the small ones
    assert max(waits[1:]) <= 1, waits
    harness.pump(rounds=200)
    ran = [r.task_id for r in harness.seen if r.task_id < 10**6]
    assert sorted(ran) == sorted(1000 * n + i for n in range(4) for i in range(20))
    firsts = [ran.index(1000 * n) for n in range(4)]
    assert max(firsts) < 8, f"each heavy client got its turn early: {firsts}"


def test_a_worker_answers_5000_pipelined_swaps_of_a_half_closed_connection(daemons: DaemonFactory) -> None:
    """A real rank worker: HELLO, 5,000 pipelined one-block swap-outs sent without reading a reply,
    ``shutdown(SHUT_WR)``, then read until the end: 5,001 replies, every swap answered OK, in order (a client
    pattern of other languages: send everything, half-close, read to EOF)."""
    daemon = daemons.start(ranks=1)
    status = daemon.wait_ready()
    count = 5000
    frames = [request(Op.HELLO, 0, json.dumps({"generation": status["generation"]}).encode())]
    ids = np.arange(count, dtype=np.int64) % 4
    frames += [request(Op.SWAP_OUT, i + 1, pack_ids(ids[i : i + 1], ids[i : i + 1])) for i in range(count)]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect(str(task_socket_path(daemons.run_dir, daemon.instance, 0)))
        sock.sendall(b"".join(frames))  # reading nothing meanwhile: the replies queue in the worker
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + 60
        while read_status(daemon.instance)["ranks"][0]["swap"]["swap_out_tasks"] < count:  # ran, answers queued
            assert time.monotonic() < deadline, "the swaps did not all run within 60 s"
            time.sleep(0.05)
        received = bytearray()
        while chunk := sock.recv(1 << 20):
            received += chunk
    answers = []
    while received:
        _, op, status_code, task_id, length = REPLY.unpack_from(received)
        answers.append((op, status_code, task_id))
        del received[: REPLY.size + length]
    assert answers[0][:2] == (Op.HELLO, Status.OK)
    assert answers[1:] == [(Op.SWAP_OUT, Status.OK, i + 1) for i in range(count)]


def test_clients_sending_large_tasks_one_at_a_time_cost_another_at_most_one_turn() -> None:
    """Four clients each keep one task that moves 64 MiB in flight (the next sent once the last is answered); a
    fifth sends a small task after theirs now and then (after a round of
    theirs): once each has had a turn, it runs after at most one large task, never behind a round of the four,
    and the large ones take turns."""
    harness = MovingHarness()
    heavy = [harness.connect() for _ in range(4)]
    light = harness.connect()
    large, small = (64 << 20).to_bytes(8, "little"), (4096).to_bytes(8, "little")
    next_id = {sock: 1000 * n for n, sock in enumerate(heavy)}
    for sock in heavy:
        sock.sendall(request(Op.SWAP_OUT, next_id[sock], large))
    waits = []
    for i in range(20):
        for sock in heavy:  # each answered one sends its next: all four ready again, before the small task
            if select.select([sock], [], [], 0)[0]:
                assert read_reply(sock)[2] == next_id[sock]
                next_id[sock] += 1
                sock.sendall(request(Op.SWAP_OUT, next_id[sock], large))
        waits.append(harness.wait_of(light, 10**6 + i, small))
        harness.pump(rounds=5)  # a round of the large tasks between the small ones
    assert max(waits[1:]) <= 1, waits
    ran = [r.task_id // 1000 for r in harness.seen if r.task_id < 10**6]
    assert all(ran.count(n) >= 4 for n in range(4)), f"each large client took its turns: {ran}"


def _steady_beside_newcomers(
    harness: MovingHarness, connect: Callable[[], socket.socket], hello_apart: bool, tasks: int
) -> dict[str, int]:
    """A steady connection keeps one 64 MiB task in flight while four clients send every such task on a new
    connection from ``connect``, saying HELLO first (and waiting for its answer if ``hello_apart``, as
    ``runner_client`` does; else in the same write); the tasks each side got done."""
    large = (64 << 20).to_bytes(8, "little")
    steady = connect()
    harness.pump(rounds=1)
    steady.sendall(request(Op.SWAP_OUT, 0, large))
    fresh: list[socket.socket] = []
    done = {"steady": 0, "fresh": 0}
    for task in range(1, tasks + 1):
        for sock in list(fresh):
            if select.select([sock], [], [], 0)[0]:
                read_reply(sock)
                if not hello_apart:
                    read_reply(sock)
                sock.close()
                fresh.remove(sock)
                done["fresh"] += 1
        while len(fresh) < 4:
            sock = connect()
            hello, work = request(Op.HELLO, 0, b"{}"), request(Op.SWAP_OUT, 10**6 + task * 10 + len(fresh), large)
            if hello_apart:
                sock.sendall(hello)
                harness.pump(rounds=2)
                read_reply(sock)
            sock.sendall(work if hello_apart else hello + work)
            fresh.append(sock)
        harness.pump(rounds=1)
        if select.select([steady], [], [], 0)[0]:
            assert read_reply(steady)[2] == done["steady"]
            done["steady"] += 1
            steady.sendall(request(Op.SWAP_OUT, done["steady"], large))
    return done


def test_a_client_that_connects_anew_for_each_task_takes_no_more_than_its_share() -> None:
    """Four clients each send every 64 MiB task on a new connection, HELLO and the task in one write; a fifth
    keeps one connection and one such task in flight: it gets its share of the turns, not the crumbs (a
    connection's first turn ends the round for those that join after it)."""
    harness = MovingHarness()
    done = _steady_beside_newcomers(harness, harness.connect, hello_apart=False, tasks=400)
    assert done["steady"] >= done["fresh"] // 5, done  # a fair share is a fifth: a quarter of theirs


def test_tasks_that_move_nothing_take_turns_too() -> None:
    """A client pipelines 3,000 lookups (they move no bytes); another sends a small swap now and then: each
    waits for at most one turn of lookups (``RUN_BATCH``), never for all of them."""
    harness = MovingHarness()
    lookups, small = harness.connect(), harness.connect()
    lookups.sendall(b"".join(request(Op.LOOKUP, 10**6 + i, (0).to_bytes(8, "little")) for i in range(3000)))
    harness.pump(rounds=2)
    waits = []
    for i in range(5):
        before = len(harness.seen)
        small.sendall(request(Op.SWAP_OUT, i, (4096).to_bytes(8, "little")))
        for _ in range(100):
            harness.pump(rounds=1)
            if select.select([small], [], [], 0)[0]:
                break
            if select.select([lookups], [], [], 0)[0]:
                lookups.recv(1 << 20)
        assert read_reply(small)[2] == i
        waits.append([r.task_id for r in harness.seen[before:]].index(i))
    assert max(waits) <= RUN_BATCH, waits


def test_a_newcomer_waits_for_no_round_when_clients_pause_between_bursts(tmp_path: Path) -> None:
    """Four clients, each a process of its own, send bursts of 64 MiB tasks and pause between them; now and then
    a new process connects and sends a small task: it runs after at most one task of each of the four, whatever
    the others did before (it joins the round under way, last: a stream of new connections cannot keep those
    waiting from their turns)."""
    listener, path = _listening(tmp_path)
    harness = MovingHarness(listener)
    harness.server.listen()
    try:
        heavy = [_dial_from_a_child(path) for _ in range(4)]
        large, small = (64 << 20).to_bytes(8, "little"), (4096).to_bytes(8, "little")
        waits = []
        for cycle in range(8):
            for n, sock in enumerate(heavy[: 1 + cycle % 4]):  # a different number of them busy each time
                sock.sendall(b"".join(request(Op.SWAP_OUT, 1000 * n + 10 * cycle + i, large) for i in range(3)))
            harness.pump(rounds=2 + cycle)
            newcomer = _dial_from_a_child(path)
            harness.pump(rounds=1)  # accepted
            waits.append(harness.wait_of(newcomer, 10**6 + cycle, small))
            newcomer.close()
            harness.pump(rounds=200)  # the bursts finish: everyone pauses
            for sock in heavy:
                while select.select([sock], [], [], 0)[0]:
                    sock.recv(1 << 16)
        assert max(waits) <= 4, waits
    finally:
        harness.server.stop_listening()


def test_connections_each_from_a_new_process_take_no_more_than_one_clients_share(tmp_path: Path) -> None:
    """Four clients send every 64 MiB task on a connection made by a new process, saying HELLO first and waiting
    for its answer (as ``runner_client`` does); a fifth keeps its connection and one such task in flight: it
    gets its share of the turns, as beside four clients that keep theirs, not the crumbs."""
    listener, path = _listening(tmp_path)
    harness = MovingHarness(listener)
    harness.server.listen()
    try:
        done = _steady_beside_newcomers(harness, lambda: _dial_from_a_child(path), hello_apart=True, tasks=120)
        assert done["steady"] >= done["fresh"] // 8, done  # a fair share is a fifth: a quarter of theirs
    finally:
        harness.server.stop_listening()


def test_a_client_with_one_large_task_in_flight_waits_for_one_task_of_each_small_client() -> None:
    """A client keeps one 64 MiB task in flight beside four that each keep one small task in flight: once each
    has run its first (each of which starts a round), between two of its tasks each of the four runs at most one
    (a large task's bytes do not buy the small clients a thousand turns: turns go round by round)."""
    harness = MovingHarness()
    heavy, lights = harness.connect(), [harness.connect() for _ in range(4)]
    large, small = (64 << 20).to_bytes(8, "little"), (4096).to_bytes(8, "little")
    heavy.sendall(request(Op.SWAP_OUT, 0, large))
    for sock in lights:
        sock.sendall(request(Op.SWAP_OUT, 1, small))
    between, count = [], 0
    while len(between) < 20:
        harness.pump(rounds=1)
        for sock in lights:
            if select.select([sock], [], [], 0)[0]:
                read_reply(sock)
                count += 1
                sock.sendall(request(Op.SWAP_OUT, 1, small))
        if select.select([heavy], [], [], 0)[0]:
            read_reply(heavy)
            between.append(count)
            count = 0
            heavy.sendall(request(Op.SWAP_OUT, 0, large))
    assert max(between[3:]) <= 4, between


def test_a_storm_of_connections_that_only_say_hello_keeps_no_one_from_their_turns(tmp_path: Path) -> None:
    """New connections arrive faster than turns are served, each saying HELLO and leaving: between two tasks of
    a client keeping one in flight, about ``ACCEPT_BATCH`` of them run, not more and more (connections wait in
    the kernel's queue while that many new ones wait for their first turns; a new one goes last in its
    round)."""
    listener, path = _listening(tmp_path)
    harness = MovingHarness(listener)
    harness.server.listen()
    try:
        victim = _dial(path)
        harness.pump(rounds=1)
        victim.sendall(request(Op.SWAP_OUT, 0, (4096).to_bytes(8, "little")))
        done, between, before = 0, [], 0
        for _ in range(400):
            for _ in range(20):
                with contextlib.suppress(OSError), _dial(path) as storm:
                    storm.sendall(request(Op.HELLO, 0, b"{}"))
            harness.pump(rounds=1)
            if select.select([victim], [], [], 0)[0]:
                assert read_reply(victim)[2] == done
                between.append(len(harness.seen) - before - 1)
                before = len(harness.seen)
                done += 1
                victim.sendall(request(Op.SWAP_OUT, done, (4096).to_bytes(8, "little")))
        assert done >= 4 and max(between) <= 2 * ACCEPT_BATCH, between
    finally:
        harness.server.stop_listening()


def test_busy_connections_waiting_for_their_turns_keep_no_new_client_out(tmp_path: Path) -> None:
    """More than ``ACCEPT_BATCH`` connections pipelining tasks keep the backlog full: a new client is still
    accepted and served (only new connections waiting for their first turns hold the listener back)."""
    listener, path = _listening(tmp_path)
    harness = MovingHarness(listener)
    harness.server.listen()
    try:
        busy = []
        for _ in range(ACCEPT_BATCH + 8):
            busy.append(_dial(path))
            harness.pump(rounds=1)
        for n, sock in enumerate(busy):
            sock.sendall(b"".join(request(Op.LOOKUP, 1000 * n + i, bytes(8)) for i in range(200)))
        harness.pump(rounds=ACCEPT_BATCH + 8)  # each has had its first turn, and waits for more
        assert len(harness.server.backlog) > ACCEPT_BATCH
        newcomer = _dial(path)
        assert harness.wait_of(newcomer, 10**6, bytes(8), rounds=4 * len(busy)) <= len(busy) * RUN_BATCH
    finally:
        harness.server.stop_listening()
