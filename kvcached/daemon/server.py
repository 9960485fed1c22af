"""A rank worker's task server: accepts runner connections on the rank's socket and executes their tasks.

Single-threaded, driven by the worker's selector. Nothing a client does can end the worker or stall
the others:

* every connection is non-blocking; replies queue in the connection's output buffer and go out as the
  client reads them. A client that stops reading stalls only itself: past ``OUT_CAP`` queued bytes the
  server stops reading its requests until it drains;
* a request's bytes are buffered until the whole frame is there, at most ``MAX_PAYLOAD`` per frame. A
  frame larger than a read must first reserve its length from ``INPUT_BUDGET``; while the budget is
  spent, such connections, and connections with nothing reserved once ``INPUT_BUDGET`` bytes are
  buffered, are not read (their clients wait): buffered requests stay near ``2 * INPUT_BUDGET`` whatever
  clients do. A frame left half-sent for ``PARTIAL_IDLE_S`` closes its connection;
* at most ``max_connections`` connections (below the process's open-file limit). At the cap, the
  connection idle the longest (nothing buffered, no request for ``IDLE_EVICT_S``) is closed to make room
  (its client reconnects on its next task); with none idle, the newcomer is answered REFUSED
  ("capacity") and closed. Running out of descriptors (EMFILE) is met the same way, with a descriptor kept
  in reserve for it;
* a malformed frame closes that connection only; an invalid task is answered INVALID with nothing
  changed; store calls have a deadline (``kvcached.daemon.store_agent``): a slow store fails its task.

Handing over (``kvcached restart``, ``stop --keep``): the worker stops accepting connections and answers
every task that still arrives NOT_RUN, so its client sends it to the next daemon; it exits once its clients
are quiet.

Keys: a ``swap_out`` with keys enters its CPU blocks in the rank's key directory (``kvcached.daemon.keydir``)
once copied, and writes them through to the store when there is one; ``lookup`` and ``load`` find each key
in the CPU pool first, then in the store.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import selectors
import socket
import time
from typing import Any

import numpy as np

from kvcached.access import Access, peer_of
from kvcached.copy_engine import Array, SwapEngine
from kvcached.daemon.keydir import KeyDirectory
from kvcached.daemon.store_agent import StoreCalls
from kvcached.logs import Logger
from kvcached.protocol.errors import InvalidTask, StoreUnavailable
from kvcached.protocol.messages import (
    FLAG_KEYS,
    KEY_BYTES,
    MAX_PAYLOAD,
    REQUEST,
    REQUEST_MAGIC,
    TASK_RESULT,
    Op,
    Status,
    reply,
    unpack_ids,
    unpack_keyed,
)
from kvcached.protocol.stats import StatsSlot

RECV_CHUNK = 1 << 20
#: Reply bytes a connection may have queued before its requests stop being read.
OUT_CAP = 4 << 20
#: Bytes of unfinished request frames held over all connections.
INPUT_BUDGET = 2 * MAX_PAYLOAD
#: A frame left unfinished this long closes its connection.
PARTIAL_IDLE_S = 30.0
#: A connection this long without a request may be closed to make room for a new one at the cap.
IDLE_EVICT_S = 1.0
#: Descriptors kept free below the open-file limit (the worker's own files, the reserve).
FD_HEADROOM = 64


class _Conn:
    """One client connection: its socket, unparsed and unsent bytes, and what it waits for."""

    __slots__ = (
        "active",
        "events",
        "filled",
        "frame",
        "frame_header",
        "greeted",
        "inbuf",
        "need",
        "outbuf",
        "partial_since",
        "reserved",
        "sock",
        "starved",
    )

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.greeted = False
        self.starved = False  # waiting for the input budget
        self.reserved = 0  # bytes of INPUT_BUDGET its unfinished large frame holds
        self.frame: bytearray | None = None  # that frame's payload, filled in place
        self.frame_header: tuple[Any, ...] = ()
        self.filled = 0
        self.need = 0  # the length of a large frame waiting for room in the budget
        self.partial_since = 0.0  # when the unfinished frame in inbuf started (0: none)
        self.events = 0  # what the selector watches now
        self.active = time.monotonic()  # when it last sent a request


class TaskServer:
    """Executes tasks for one rank. ``stats`` is the rank's slot in the control block."""

    def __init__(
        self,
        *,
        listener: socket.socket,
        selector: selectors.BaseSelector,
        engine: SwapEngine,
        stats: StatsSlot,
        rank: int,
        generation: int,
        log: Logger,
        store: StoreCalls | None = None,
        access: Access | None = None,
        max_connections: int | None = None,
        keys: KeyDirectory | None = None,
    ) -> None:
        self.listener = listener
        self.selector = selector
        self.access = access or Access.for_daemon(None)
        self.engine = engine
        self.stats = stats
        self.rank = rank
        self.generation = generation
        self.log = log
        self.store = store
        #: The CPU pool's key directory (None without a pool): ``swap_out`` with keys enters blocks there.
        self.keys = keys
        self.conns: dict[int, _Conn] = {}
        self.buffered = 0  # bytes in every connection's inbuf
        self.reserved = 0  # bytes of INPUT_BUDGET reserved by unfinished large frames
        self.starved: set[_Conn] = set()  # connections not read until the budget has room
        self.scratch = bytearray(RECV_CHUNK)  # one receive buffer, reused: no allocation per message
        self.scratch_view = memoryview(self.scratch)
        self.max_connections = max_connections or connection_limit()
        self.reserve_fd: int | None = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        self.store_failures = 0  # store tasks that failed (the backend counts its own errors besides)
        self.handing_over = False  # tasks are answered NOT_RUN: the next daemon runs them
        if store is not None:
            self._mirror_store_counters()  # a rebuilt index shows in status before the first task

    # -- connections ----------------------------------------------------------------------------------

    def accept(self) -> None:
        """Accept what is waiting on the listener (at most 64 per call, so tasks keep being served)."""
        for _ in range(64):
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
                self._refuse(sock, "capacity", f"the worker of rank {self.rank} has {len(self.conns)} connections open")
                continue
            peer = peer_of(sock)
            if not self.access.allows(peer):
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
                continue
            sock.setblocking(False)
            conn = _Conn(sock)
            self.conns[sock.fileno()] = conn
            self._watch(conn)
            self.stats.count(connections=1)

    def _evict_idle(self) -> bool:
        """Close the connection idle the longest, if one has been idle for ``IDLE_EVICT_S``."""
        idle = [c for c in self.conns.values() if not c.inbuf and not c.outbuf]
        oldest = min(idle, key=lambda c: c.active, default=None)
        if oldest is None or time.monotonic() - oldest.active < IDLE_EVICT_S:
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
        try:
            sock, _ = self.listener.accept()
        except OSError:
            pass
        else:
            self._refuse(sock, "capacity", f"the worker of rank {self.rank} is out of file descriptors")
        with contextlib.suppress(OSError):
            self.reserve_fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)

    def _watch(self, conn: _Conn) -> None:
        """Point the selector at what ``conn`` waits for now."""
        events = 0
        if len(conn.outbuf) <= OUT_CAP and not conn.starved:
            events |= selectors.EVENT_READ
        if conn.outbuf:
            events |= selectors.EVENT_WRITE
        if events == conn.events:
            return
        if conn.events == 0:
            self.selector.register(conn.sock, events, "client")
        elif events == 0:
            self.selector.unregister(conn.sock)
        else:
            self.selector.modify(conn.sock, events, "client")
        conn.events = events

    def close(self, sock: socket.socket) -> None:
        """Forget and close a connection."""
        conn = self.conns.pop(sock.fileno(), None)
        if conn is not None:
            if conn.events:
                self.selector.unregister(sock)
            self.buffered -= len(conn.inbuf) + conn.filled
            self.reserved -= conn.reserved
            self.starved.discard(conn)
            self._feed_starved()
        sock.close()

    def on_event(self, sock: socket.socket, events: int) -> None:
        """Handle the selector's news for a client connection."""
        conn = self.conns.get(sock.fileno())
        if conn is None:
            return
        if events & selectors.EVENT_WRITE and not self._flush(conn):
            self.close(sock)
            return
        if events & selectors.EVENT_READ and not self._on_readable(conn):
            self.close(sock)
            return
        self._watch(conn)

    def hand_over(self) -> None:
        """From now on, answer every task NOT_RUN (its client sends it to the daemon that adopts the rank)."""
        self.handing_over = True

    def sending(self) -> bool:
        """Whether a reply is still queued for a client."""
        return any(conn.outbuf for conn in self.conns.values())

    def flush_all(self, seconds: float) -> None:
        """Send every queued reply, waiting at most ``seconds`` in all (before a handover's exit: a task that
        ran is answered; one whose connection closes unanswered did not run)."""
        deadline = time.monotonic() + seconds
        for conn in list(self.conns.values()):
            if not conn.outbuf:
                continue
            try:
                conn.sock.settimeout(max(0.001, deadline - time.monotonic()))
                conn.sock.sendall(conn.outbuf)
                conn.outbuf.clear()
            except OSError:
                continue

    def tick(self, now: float) -> None:
        """Close connections whose unfinished frame stalled for ``PARTIAL_IDLE_S``."""
        for conn in [c for c in self.conns.values() if c.partial_since and now - c.partial_since > PARTIAL_IDLE_S]:
            self.log.warning(
                "closing a connection that left a frame unfinished", seconds=round(now - conn.partial_since)
            )
            self.close(conn.sock)

    def _on_readable(self, conn: _Conn) -> bool:
        """Read what arrived and run every complete task; False when the connection should close."""
        if not conn.reserved and self.buffered >= INPUT_BUDGET:
            self._starve(conn)  # others hold the budget: wait for it instead of growing without bound
            return True
        # A large frame is read straight into its own buffer, allocated once at its reserved length.
        target = memoryview(conn.frame)[conn.filled :] if conn.frame is not None else self.scratch
        try:
            got = conn.sock.recv_into(target)
        except BlockingIOError:
            return True
        except OSError:
            got = 0
        if not got:
            return False
        conn.active = time.monotonic()
        self.buffered += got
        if conn.frame is not None:
            conn.filled += got
        else:
            conn.inbuf += self.scratch_view[:got]
        ok = self._run_frames(conn)
        pending = conn.inbuf or conn.frame is not None
        conn.partial_since = (conn.partial_since or time.monotonic()) if pending else 0.0
        self._feed_starved()
        return ok and self._flush(conn)

    def _run_frames(self, conn: _Conn) -> bool:
        while True:
            if conn.frame is not None:  # a large frame, filled in place
                if conn.filled < len(conn.frame):
                    return True
                header, payload, conn.frame, conn.filled = conn.frame_header, bytes(conn.frame), None, 0
                self.buffered -= len(payload)
                self.reserved -= conn.reserved
                conn.reserved = 0
                if not self._run(conn, header, payload):
                    return True
                continue
            if len(conn.inbuf) < REQUEST.size:
                return True
            header = REQUEST.unpack_from(conn.inbuf)
            magic, op, _flags, task_id, length = header
            if magic != REQUEST_MAGIC or length > MAX_PAYLOAD:
                why = (
                    "bad frame magic"
                    if magic != REQUEST_MAGIC
                    else f"payload of {length} bytes exceeds the limit of {MAX_PAYLOAD} bytes per task: split it"
                )
                conn.outbuf += reply(op, Status.INVALID, task_id, {"field": "frame", "message": why})
                self.stats.count(tasks_refused=1)
                self._flush(conn)
                return False
            if len(conn.inbuf) >= REQUEST.size + length:
                payload = bytes(conn.inbuf[REQUEST.size : REQUEST.size + length])
                del conn.inbuf[: REQUEST.size + length]
                self.buffered -= REQUEST.size + length
                if not self._run(conn, header, payload):
                    return True
                continue
            if length > RECV_CHUNK:  # a large frame: reserve its whole length, or wait for room
                if self.reserved + length > INPUT_BUDGET:
                    conn.need = length
                    self._starve(conn)
                    return True
                conn.need = 0
                conn.reserved = length
                self.reserved += length
                conn.frame, conn.frame_header = bytearray(length), header
                have = len(conn.inbuf) - REQUEST.size
                conn.frame[:have] = conn.inbuf[REQUEST.size :]
                conn.filled = have
                self.buffered -= REQUEST.size
                conn.inbuf.clear()
            return True

    def _run(self, conn: _Conn, header: tuple[Any, ...], payload: bytes) -> bool:
        """Execute one request and queue its reply; False when the client stopped reading its replies (then
        its requests are not taken until it does)."""
        _, op, flags, task_id, _ = header
        conn.partial_since = 0.0
        conn.outbuf += self._execute(conn, op, flags, task_id, payload)
        return len(conn.outbuf) <= OUT_CAP

    def _flush(self, conn: _Conn) -> bool:
        """Send what the socket takes now; False when the client is gone."""
        while conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
            except BlockingIOError:
                return True
            except OSError:  # the client left: its replies are lost, the rank serves on
                return False
            del conn.outbuf[:sent]
        return True

    def _starve(self, conn: _Conn) -> None:
        conn.starved = True
        self.starved.add(conn)

    def _feed_starved(self) -> None:
        """Read again from starved connections once the budget has room for what each waits for."""
        for conn in list(self.starved):
            if conn.sock.fileno() < 0:  # closed meanwhile
                self.starved.discard(conn)
                continue
            if self.reserved + conn.need <= INPUT_BUDGET if conn.need else self.buffered < INPUT_BUDGET:
                conn.starved = False
                self.starved.discard(conn)
                self._watch(conn)

    # -- tasks ----------------------------------------------------------------------------------------

    def _execute(self, conn: _Conn, op: int, flags: int, task_id: int, payload: bytes) -> bytes:
        try:
            if op == Op.HELLO:
                return self._hello(conn, task_id, payload)
            if not conn.greeted:
                raise InvalidTask("hello", "send HELLO with the daemon generation first")
            if self.handing_over:
                message = "not run: this daemon is handing the rank over to the next one; send it there"
                return reply(op, Status.NOT_RUN, task_id, {"message": message})
            if op in (Op.SWAP_OUT, Op.SWAP_IN):
                return self._swap(Op(op), flags, task_id, payload)
            if op in (Op.STORE, Op.LOAD, Op.LOOKUP):
                return self._store_op(Op(op), task_id, payload)
            raise InvalidTask("op", f"unknown operation {op}; known: {', '.join(o.name for o in Op)}")
        except InvalidTask as exc:
            self.stats.count(tasks_refused=1)
            return reply(op, Status.INVALID, task_id, {"field": exc.field, "message": exc.message})
        except StoreUnavailable as exc:
            self.store_failures += 1
            body = {"message": f"storage backend unavailable: {exc}", "store_unavailable": True}
            return reply(op, Status.FAILED, task_id, body)
        except Exception as exc:
            if op in (Op.STORE, Op.LOAD, Op.LOOKUP) or flags & FLAG_KEYS:
                self.store_failures += 1
            self.log.exception("task failed", op=op, task_id=task_id)
            return reply(op, Status.FAILED, task_id, {"message": f"{type(exc).__name__}: {exc}"})

    def _hello(self, conn: _Conn, task_id: int, payload: bytes) -> bytes:
        try:
            theirs = json.loads(payload).get("generation")
        except (ValueError, AttributeError):
            raise InvalidTask("hello", "payload must be a JSON object with the generation") from None
        ours = f"{self.generation:016x}"
        if theirs != ours:
            raise InvalidTask("generation", f"client expects generation {theirs}, this daemon is {ours}")
        conn.greeted = True
        spec = self.engine.spec
        body = {
            "rank": self.rank,
            "generation": ours,
            "num_blocks": spec.num_blocks,
            "num_cpu_blocks": spec.num_cpu_blocks,
            "block_bytes": spec.block_bytes,
        }
        return reply(Op.HELLO, Status.OK, task_id, body)

    def _swap(self, op: Op, flags: int, task_id: int, payload: bytes) -> bytes:
        keys: list[bytes] = []
        if op is Op.SWAP_OUT and flags & FLAG_KEYS:
            keyed = unpack_keyed(payload, 2)
            if keyed is None:
                raise InvalidTask("payload", f"{len(payload)} bytes is not n device ids, n CPU ids and n keys")
            (src, dst), keys = keyed
        else:
            ids = unpack_ids(payload)
            if ids is None:
                raise InvalidTask("payload", f"{len(payload)} bytes is not two equal lists of int32 block ids")
            src, dst = ids
        out = op is Op.SWAP_OUT
        tiers = ("device", "cpu") if out else ("cpu", "device")
        self.engine.validate(src, dst, src_tier=tiers[0], dst_tier=tiers[1])
        if keys and self.store is not None:  # write-through, store first: if it fails, the pool has not changed
            self._put_blocks(src, keys)
        started = time.monotonic_ns()
        if out and self.keys is not None:
            self.keys.forget(dst.tolist())  # before a byte of them changes (see kvcached.daemon.keydir)
        moved = self.engine.swap_out(src, dst) if out else self.engine.swap_in(src, dst)
        if keys and self.keys is not None:
            self.keys.publish(dst.tolist(), keys)
        took = time.monotonic_ns() - started
        self.stats.count_task("swap_out" if out else "swap_in", len(src), moved, took)
        return reply(op, Status.OK, task_id, TASK_RESULT.pack(len(src), moved, took))

    # -- attention store ------------------------------------------------------------------------------

    def _require_store(self) -> StoreCalls:
        store = self.store
        if store is None:
            raise InvalidTask(
                "storage_backend", "this instance has no attention store (start it with --storage-backend)"
            )
        return store

    def _put_blocks(self, device_ids: Array, keys: list[bytes]) -> int:
        """Store device blocks under ``keys``: in one call straight from the blocks (``direct``), else a
        staging buffer at a time; bytes newly written."""
        store = self._require_store()
        staging = store.staging
        started = time.monotonic_ns()
        written = 0
        store.call("protect", keys)
        try:
            if store.direct:
                written = store.call("put_blocks", keys, device_ids.tolist())
            else:
                for start in range(0, len(keys), len(staging)):
                    chunk = device_ids[start : start + len(staging)]
                    self.engine.copy_out(chunk, np.arange(len(chunk)), staging)
                    written += store.call("put_many", keys[start : start + len(chunk)])
        finally:
            with contextlib.suppress(StoreUnavailable):
                store.call("protect", [])
            self._mirror_store_counters()
        nbytes = written * self.engine.spec.block_bytes
        self.stats.count_task("store", len(keys), nbytes, time.monotonic_ns() - started)
        return nbytes

    def _store_op(self, op: Op, task_id: int, payload: bytes) -> bytes:
        try:
            return self._store_task(op, task_id, payload)
        finally:
            if self.store is not None:
                self._mirror_store_counters()

    def _store_task(self, op: Op, task_id: int, payload: bytes) -> bytes:
        started = time.monotonic_ns()
        if op is Op.LOOKUP:
            if len(payload) % KEY_BYTES:
                raise InvalidTask("keys", f"{len(payload)} bytes is not a list of {KEY_BYTES}-byte keys")
            self._require_keyed_tier()
            keys = [payload[i : i + KEY_BYTES] for i in range(0, len(payload), KEY_BYTES)]
            found = self._present(keys)
            self.stats.count(lookup_tasks=1)
            return reply(op, Status.OK, task_id, TASK_RESULT.pack(found, 0, time.monotonic_ns() - started))
        keyed = unpack_keyed(payload, 1)
        if keyed is None:
            raise InvalidTask("payload", f"{len(payload)} bytes is not n device block ids and n keys")
        (ids,), keys = keyed
        if op is Op.STORE:
            self._require_store()
            self.engine.check_ids(ids, field="device_block_ids", role="source", unique=False)
            nbytes = self._put_blocks(ids, keys)
            return reply(op, Status.OK, task_id, TASK_RESULT.pack(len(keys), nbytes, time.monotonic_ns() - started))
        self._require_keyed_tier()
        self.engine.check_ids(ids, field="device_block_ids", role="target", unique=True)
        loaded = self._load_blocks(keys, ids)
        nbytes = loaded * self.engine.spec.block_bytes
        took = time.monotonic_ns() - started
        self.stats.count_task("load", loaded, nbytes, took)
        return reply(op, Status.OK, task_id, TASK_RESULT.pack(loaded, nbytes, took))

    def _require_keyed_tier(self) -> None:
        if self.store is None and self.keys is None:
            raise InvalidTask(
                "storage_backend",
                "this instance has neither a CPU pool nor an attention store to find keys in "
                "(start it with --num-cpu-blocks > 0 or --storage-backend)",
            )

    def _in_pool(self, key: bytes) -> int | None:
        return self.keys.find(key) if self.keys is not None else None

    def _store_run(self, keys: list[bytes], start: int) -> int:
        """The end of the run of keys from ``start`` that the CPU pool does not hold."""
        end = start + 1
        while end < len(keys) and self._in_pool(keys[end]) is None:
            end += 1
        return end

    def _present(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` a host tier holds: the CPU pool (its key directory) or the store."""
        found = 0
        while found < len(keys):
            if self._in_pool(keys[found]) is not None:
                found += 1
                continue
            if self.store is None:
                break
            end = self._store_run(keys, found)
            got = self.store.call("present", keys[found:end])
            found += got
            if found < end:
                break
        return found

    def _load_blocks(self, keys: list[bytes], targets: Array) -> int:
        """Load the longest prefix of ``keys`` a host tier holds into device blocks ``targets``, each block
        from the fastest tier that has it: the CPU pool, else the store. Stops at the first miss."""
        loaded = 0
        while loaded < len(keys):
            pooled: list[int] = []
            while loaded + len(pooled) < len(keys):
                block = self._in_pool(keys[loaded + len(pooled)])
                if block is None:
                    break
                pooled.append(block)
            if pooled:
                self.engine.swap_in(np.array(pooled, dtype=np.int64), targets[loaded : loaded + len(pooled)])
                loaded += len(pooled)
                continue
            if self.store is None:
                break
            end = self._store_run(keys, loaded)
            got = self._load_from_store(keys[loaded:end], targets[loaded:end], self.store)
            loaded += got
            if loaded < end:
                break
        return loaded

    def _load_from_store(self, keys: list[bytes], targets: Array, store: StoreCalls) -> int:
        """Load the longest present prefix of ``keys`` from the store into device blocks ``targets``: in one
        call straight into the blocks (``direct``), else a staging buffer at a time (the store agent fills
        staging rows; this process copies them into the device tier)."""
        if store.direct:
            loaded: int = store.call("load_blocks", keys, targets.tolist())
            return loaded
        staging = store.staging
        loaded = 0
        for start in range(0, len(keys), len(staging)):
            chunk = keys[start : start + len(staging)]
            got = store.call("load_prefix", chunk)
            self.engine.copy_in(np.arange(got), targets[start : start + got], staging)
            loaded += got
            if got < len(chunk):  # stops at the first miss: a block without its prefix is of no use
                break
        return loaded

    def maintain(self) -> None:
        """Between tasks: let the store look for trouble, and show its figures (``kvcached status``)."""
        if self.store is not None:
            self.store.maintain()
            self._mirror_store_counters()

    def _mirror_store_counters(self) -> None:
        assert self.store is not None
        c = self.store.counters
        self.stats.set(
            store_errors=self.store_failures + c.errors,
            store_objects=c.objects,
            store_bytes_used=c.bytes,
            store_hits=c.hits,
            store_misses=c.misses,
            store_evictions=c.evictions,
            store_corrupt=c.corrupt,
            store_master_resets=c.master_resets,
        )


def connection_limit() -> int:
    """Connections a worker accepts: what its open-file limit leaves after ``FD_HEADROOM``."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = 1 << 16 if soft == resource.RLIM_INFINITY else soft
    return max(8, min(1 << 16, limit - FD_HEADROOM))


def raise_file_limit() -> None:
    """Raise the soft open-file limit to the hard one (the usual 1024 is low for a busy rank)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
