"""A rank worker's task server: accepts runner connections on the rank's socket and executes their tasks.

Single-threaded, driven by the worker's selector: a connection's bytes are buffered until a whole frame
is there, the task runs to completion, the reply goes back. Nothing a client sends can end the worker:
a malformed frame closes that connection only, an invalid task is answered INVALID with nothing changed,
and a client that vanishes mid-task only loses its reply.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import time

from kvcached.access import Access, peer_of
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
from kvcached.store.base import Store
from kvcached.transfer import SwapEngine

RECV_CHUNK = 1 << 20
SEND_TIMEOUT_S = 5


class _Conn:
    """One client connection: its socket, unparsed bytes, and whether it said HELLO."""

    __slots__ = ("buf", "greeted", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.greeted = False


class TaskServer:
    """Executes swap tasks for one rank. ``stats`` is the rank's counter array in the control block."""

    def __init__(
        self,
        *,
        listener: socket.socket,
        engine: SwapEngine,
        stats: StatsSlot,
        rank: int,
        generation: int,
        log: Logger,
        store: Store | None = None,
        access: Access | None = None,
    ) -> None:
        self.listener = listener
        self.access = access or Access.for_daemon(None)
        self.engine = engine
        self.stats = stats
        self.rank = rank
        self.generation = generation
        self.log = log
        self.conns: dict[int, _Conn] = {}
        self.store = store
        self.scratch = bytearray(RECV_CHUNK)  # one receive buffer, reused: no allocation per message
        self.scratch_view = memoryview(self.scratch)
        if store is not None:
            self._mirror_store_counters()  # a rebuilt index shows in status before the first task

    # -- connections ----------------------------------------------------------------------------------

    def accept(self) -> socket.socket | None:
        """Accept one connection if its peer may talk to us (see ``kvcached.daemon.access``); else log and
        close it before reading anything."""
        try:
            sock, _ = self.listener.accept()
        except BlockingIOError:
            return None
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
            self.stats.count(tasks_refused=1)
            why = f"uid {peer.uid} is neither the daemon's user (uid {self.access.uid}) nor in its group"
            with contextlib.suppress(OSError):
                sock.send(reply(Op.HELLO, Status.REFUSED, 0, {"message": why}), socket.MSG_DONTWAIT)
            sock.close()
            return None
        # Blocking (no poll() before each call: select already said readable), but a send to a client
        # that stopped reading its replies gives up after SEND_TIMEOUT_S instead of stalling the rank.
        sock.setblocking(True)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_S, 0))
        self.conns[sock.fileno()] = _Conn(sock)
        self.stats.count(connections=1)
        return sock

    def close(self, sock: socket.socket) -> None:
        """Forget and close a connection."""
        self.conns.pop(sock.fileno(), None)
        sock.close()

    def on_readable(self, sock: socket.socket) -> bool:
        """Read what arrived and run every complete task; False when the caller should close it."""
        conn = self.conns[sock.fileno()]
        try:
            got = sock.recv_into(self.scratch)
        except OSError:
            got = 0
        if not got:
            return False
        conn.buf += self.scratch_view[:got]
        while len(conn.buf) >= REQUEST.size:
            magic, op, flags, task_id, length = REQUEST.unpack_from(conn.buf)
            if magic != REQUEST_MAGIC or length > MAX_PAYLOAD:
                why = (
                    "bad frame magic" if magic != REQUEST_MAGIC else f"payload of {length} bytes exceeds {MAX_PAYLOAD}"
                )
                self._send(conn, reply(op, Status.INVALID, task_id, {"field": "frame", "message": why}))
                self.stats.count(tasks_refused=1)
                return False
            if len(conn.buf) < REQUEST.size + length:
                break
            payload = bytes(conn.buf[REQUEST.size : REQUEST.size + length])
            del conn.buf[: REQUEST.size + length]
            if not self._send(conn, self._execute(conn, op, flags, task_id, payload)):
                return False
        return True

    def _send(self, conn: _Conn, frame: bytes) -> bool:
        try:
            conn.sock.sendall(frame)
        except OSError:  # the client left (or stopped reading): its reply is lost, the rank serves on
            return False
        return True

    # -- tasks ----------------------------------------------------------------------------------------

    def _execute(self, conn: _Conn, op: int, flags: int, task_id: int, payload: bytes) -> bytes:
        try:
            if op == Op.HELLO:
                return self._hello(conn, task_id, payload)
            if not conn.greeted:
                raise InvalidTask("hello", "send HELLO with the daemon generation first")
            if op in (Op.SWAP_OUT, Op.SWAP_IN):
                return self._swap(Op(op), flags, task_id, payload)
            if op in (Op.STORE, Op.LOAD, Op.LOOKUP):
                return self._store_op(Op(op), task_id, payload)
            raise InvalidTask("op", f"unknown operation {op}; known: {', '.join(o.name for o in Op)}")
        except InvalidTask as exc:
            self.stats.count(tasks_refused=1)
            return reply(op, Status.INVALID, task_id, {"field": exc.field, "message": exc.message})
        except StoreUnavailable as exc:
            self.stats.count(store_errors=1)
            return reply(op, Status.FAILED, task_id, {"message": f"storage backend unavailable: {exc}"})
        except Exception as exc:
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
            self._require_store()
        else:
            ids = unpack_ids(payload)
            if ids is None:
                raise InvalidTask("payload", f"{len(payload)} bytes is not two equal lists of int32 block ids")
            src, dst = ids
        out = op is Op.SWAP_OUT
        tiers = ("device", "cpu") if out else ("cpu", "device")
        self.engine.validate(src, dst, src_tier=tiers[0], dst_tier=tiers[1])
        started = time.monotonic_ns()
        moved = self.engine.swap_out(src, dst) if out else self.engine.swap_in(src, dst)
        took = time.monotonic_ns() - started
        self.stats.count_task("swap_out" if out else "swap_in", len(src), moved, took)
        if keys:  # write-through: the blocks just swapped out also go to the store
            self._put_blocks(src.tolist(), keys)
        return reply(op, Status.OK, task_id, TASK_RESULT.pack(len(src), moved, took))

    # -- attention store ------------------------------------------------------------------------------

    def _require_store(self) -> Store:
        store: Store | None = self.store
        if store is None:
            raise InvalidTask(
                "storage_backend", "this instance has no attention store (start it with --storage-backend)"
            )
        return store

    def _put_blocks(self, device_ids: list[int], keys: list[bytes]) -> int:
        store = self._require_store()
        store.protect(keys)
        started = time.monotonic_ns()
        try:
            stored = store.put_many(keys, [self.engine.block_pieces(device_id) for device_id in device_ids])
        finally:
            store.protect([])
            self._mirror_store_counters()
        nbytes = stored * self.engine.spec.block_bytes
        self.stats.count_task("store", len(keys), nbytes, time.monotonic_ns() - started)
        return nbytes

    def _store_op(self, op: Op, task_id: int, payload: bytes) -> bytes:
        try:
            return self._store_task(op, task_id, payload)
        finally:
            if self.store is not None:  # only store tasks change the store's counters
                self._mirror_store_counters()

    def _store_task(self, op: Op, task_id: int, payload: bytes) -> bytes:
        store = self._require_store()
        started = time.monotonic_ns()
        if op is Op.LOOKUP:
            if len(payload) % KEY_BYTES:
                raise InvalidTask("keys", f"{len(payload)} bytes is not a list of {KEY_BYTES}-byte keys")
            keys = [payload[i : i + KEY_BYTES] for i in range(0, len(payload), KEY_BYTES)]
            found = store.present(keys)
            self.stats.count(lookup_tasks=1)
            return reply(op, Status.OK, task_id, TASK_RESULT.pack(found, 0, time.monotonic_ns() - started))
        keyed = unpack_keyed(payload, 1)
        if keyed is None:
            raise InvalidTask("payload", f"{len(payload)} bytes is not n device block ids and n keys")
        (ids,), keys = keyed
        if op is Op.STORE:
            self.engine.check_ids(ids, field="device_block_ids", role="source", unique=False)
            nbytes = self._put_blocks(ids.tolist(), keys)
            return reply(op, Status.OK, task_id, TASK_RESULT.pack(len(keys), nbytes, time.monotonic_ns() - started))
        self.engine.check_ids(ids, field="device_block_ids", role="target", unique=True)
        targets = ids.tolist()
        # Stops at the first miss: a block without its prefix is of no use.
        loaded = store.load_prefix(keys, lambda i, record: self.engine.write_block(targets[i], record))
        nbytes = loaded * self.engine.spec.block_bytes
        took = time.monotonic_ns() - started
        self.stats.count_task("load", loaded, nbytes, took)
        return reply(op, Status.OK, task_id, TASK_RESULT.pack(loaded, nbytes, took))

    def _mirror_store_counters(self) -> None:
        assert self.store is not None
        c = self.store.counters
        self.stats.set(
            store_objects=c.objects,
            store_bytes_used=c.bytes,
            store_hits=c.hits,
            store_misses=c.misses,
            store_evictions=c.evictions,
            store_corrupt=c.corrupt,
        )
