"""Ask the daemon to move blocks: ``CacheTasks`` talks to each rank worker over its task socket.

    with runner_client.CacheTasks(instance="default") as tasks:
        tasks.swap_out(rank, device_block_ids=[4, 5, 6], cpu_block_ids=[0, 1, 2])   # device -> CPU pool
        tasks.swap_in(None, cpu_block_ids=[0, 1, 2], device_block_ids=[7, 8, 9])    # every rank, together
        handle = tasks.swap_out(0, [1], [3], wait=False)
        handle.result(timeout=5)

        tasks.store(None, [4, 5], keys[:2])                     # device -> attention store, every rank
        n = tasks.lookup(keys)                                  # leading keys stored for every rank
        tasks.load(None, keys[:n], [9, 10][:n])                 # store -> device

Each call moves whole blocks: every layer's key, value and scale. ``rank=None`` sends the task to every
rank of the instance and returns when all have finished (a tensor-parallel group swaps together). A
task the daemon refuses raises ``InvalidTask`` naming the field, and no block has changed on any rank.
One connection per rank, opened on first use; replies arrive in order, so one ``CacheTasks`` may be
shared by threads (each rank's connection is guarded by a lock).

A daemon that is restarted (``kvcached restart``), stopped with ``--keep`` or killed, and whose memory the
next daemon of the instance adopts, is followed: a task in flight at that moment fails with ``TaskLost``
(naming the blocks it may have half-written); later tasks wait, within their timeout and at most
``FOLLOW_S`` seconds, for the next daemon and go to it. When the next daemon made the memory anew (it did
not adopt it, or the device tier cannot outlive its process), tasks raise ``DaemonGone``: re-attach with
``initialize_kv_cache`` and open a new ``CacheTasks``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np

from kvcached.protocol.control import ControlBlock, Header, Record, State
from kvcached.protocol.errors import (
    AccessDenied,
    DaemonGone,
    InvalidTask,
    NotTrusted,
    RankFailed,
    StoreUnavailable,
    TaskFailed,
    TaskLost,
    TaskTimeout,
    TornRead,
)
from kvcached.protocol.instance import open_instance
from kvcached.protocol.messages import (
    FLAG_KEYS,
    KEY_BYTES,
    REPLY,
    REPLY_MAGIC,
    Op,
    Status,
    pack_ids,
    parse_reply_body,
    request,
    too_large,
)
from kvcached.protocol.names import instance_or_default, task_socket_path
from kvcached.protocol.proc import is_alive
from kvcached.protocol.trust import check_owner

_INT32_MAX = 2**31 - 1
#: How long, at most, a task waits for the next daemon after the one it talked to died or handed over.
FOLLOW_S = 10.0
#: Times a task the daemon did not run (NOT_RUN: it was handing over) is sent again.
MAX_RESENDS = 4


@dataclasses.dataclass(frozen=True, slots=True)
class TaskResult:
    """What a finished task did: the ranks involved, blocks and bytes per rank (the fewest of any rank:
    a load may stop early on one rank), and the slowest rank's time."""

    ranks: tuple[int, ...]
    blocks: int
    bytes: int
    seconds: float


class _Closed(Exception):
    """The rank's connection ended (EOF or reset)."""


#: Tasks a connection may have in flight (sent, reply not read yet). At the bound, ``submit`` reads
#: replies (keeping them for their handles) before it sends more: any number of ``wait=False`` tasks can
#: be submitted without the two sides' socket buffers filling up and deadlocking.
MAX_IN_FLIGHT = 128


class _Channel:
    """One connection to one rank worker; frames are sent and replies read under ``lock``. Every send and
    receive has a deadline."""

    def __init__(self, path: str, rank: int, block: ControlBlock, timeout: float) -> None:
        self.rank = rank
        self.block = block  # of the daemon it is opened to (kept mapped while this client lives)
        generation, owner = block.header().generation, block.owner_uid
        self.timeout = timeout
        self.lock = threading.Lock()
        self.next_id = 1
        self.unread = 0  # tasks sent whose reply has not been read from the socket yet
        self.early: dict[int, tuple[int, dict[str, Any]]] = {}
        self.buf = bytearray()
        try:
            check_owner(f"task socket {path}", os.stat(path), owner=owner)
        except FileNotFoundError:
            raise _Closed() from None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
            peer_uid = struct.unpack("3i", self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if peer_uid != owner:
                raise NotTrusted(f"the process serving {path} runs as uid {peer_uid}, not the daemon's uid {owner}")
        except PermissionError:
            self.sock.close()
            raise AccessDenied(
                f"rank {rank}: no permission to connect to {path}: the daemon admits its own user and the "
                "members of its --group"
            ) from None
        except BaseException:
            self.sock.close()
            raise
        self.sock.setblocking(True)
        self.rcvtimeo = 0.0
        self._set_rcvtimeo(timeout)
        self._set_sndtimeo(timeout)
        hello = json.dumps({"generation": f"{generation:016x}"}).encode()
        try:
            task_id = self.submit(Op.HELLO, hello)
        except _Closed:
            # Closed at once: a refused peer gets one REFUSED frame first; wait() raises on it.
            self.wait(0, time.monotonic() + min(timeout, 1.0))
            raise
        status, body = self.wait(task_id, time.monotonic() + timeout)
        if status != Status.OK:
            self.sock.close()
            raise DaemonGone(f"rank {rank}: the daemon's worker refused this client: {body.get('message')}")

    def submit(self, op: Op, payload: bytes, flags: int = 0) -> int:
        """Send one task; at ``MAX_IN_FLIGHT`` unread replies, read some first (kept for their handles)."""
        with self.lock:
            deadline = time.monotonic() + self.timeout
            while self.unread >= MAX_IN_FLIGHT:
                self._read_reply(deadline)
            task_id = self.next_id
            self.next_id += 1
            try:
                self.sock.sendall(request(op, task_id, payload, flags))
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise _Closed() from exc
            except (BlockingIOError, TimeoutError):  # SO_SNDTIMEO: the worker reads nothing any more
                self.sock.close()  # part of a frame may be out: this connection cannot be used again
                raise TimeoutError from None
            self.unread += 1
            return task_id

    def _fill(self, deadline: float) -> None:
        """Append at least one byte from the socket to ``self.buf``, or raise TimeoutError at ``deadline``.

        The socket is blocking with a receive timeout (SO_RCVTIMEO) instead of Python's timeout mode,
        which would poll() before every recv(): one syscall less per reply on the latency path."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            # Keep the socket's timeout unless it would overshoot the deadline, or is far shorter than
            # it (then recv would wake up needlessly): on the hot path no setsockopt is made.
            if not min(remaining, 1.0) / 2 <= self.rcvtimeo <= remaining + 0.05:
                self._set_rcvtimeo(remaining)
            try:
                chunk = self.sock.recv(1 << 16)
            except BlockingIOError:
                continue  # SO_RCVTIMEO expired: look at the deadline again
            except (ConnectionResetError, OSError) as exc:
                raise _Closed() from exc
            if not chunk:
                raise _Closed()
            self.buf += chunk
            return

    def _set_rcvtimeo(self, seconds: float) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(seconds))
        self.rcvtimeo = max(seconds, 0.001)

    def _set_sndtimeo(self, seconds: float) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(seconds))

    def _read_reply(self, deadline: float) -> None:
        """Read one reply into ``early``. Caller holds the lock."""
        while len(self.buf) < REPLY.size:
            self._fill(deadline)
        magic, op, status, got_id, length = REPLY.unpack_from(self.buf)
        if magic != REPLY_MAGIC:
            raise _Closed()
        while len(self.buf) < REPLY.size + length:
            self._fill(deadline)
        body = parse_reply_body(op, status, bytes(self.buf[REPLY.size : REPLY.size + length]))
        del self.buf[: REPLY.size + length]
        if status == Status.REFUSED:
            if body.get("reason") == "capacity":
                raise TaskFailed(f"rank {self.rank}: the worker refused the connection: {body.get('message')}")
            raise AccessDenied(f"rank {self.rank}: the daemon refused this client: {body.get('message')}")
        self.unread = max(0, self.unread - 1)
        self.early[got_id] = (status, body)

    def wait(self, task_id: int, deadline: float) -> tuple[int, dict[str, Any]]:
        """The (status, body) of ``task_id``, reading and keeping replies of other tasks on the way."""
        with self.lock:
            while task_id not in self.early:
                self._read_reply(deadline)
            return self.early.pop(task_id)

    def close(self) -> None:
        self.sock.close()


def _timeval(seconds: float) -> bytes:
    seconds = max(seconds, 0.001)
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


@dataclasses.dataclass(frozen=True, slots=True)
class _Part:
    """One rank's share of a task: its channel, its task id, the blocks it writes (for TaskLost), and what
    was sent (to send it again to the next daemon when it was not run)."""

    channel: _Channel
    task_id: int
    targets: tuple[int, ...]
    payload: bytes
    flags: int


class TaskHandle:
    """A submitted task; ``result()`` waits for every rank's reply."""

    def __init__(self, tasks: CacheTasks, op: Op, parts: list[_Part], timeout: float) -> None:
        self._tasks = tasks
        self._op = op
        self._parts = parts
        self._timeout = timeout
        self._result: TaskResult | None = None

    def result(self, timeout: float | None = None) -> TaskResult:
        """Wait (at most ``timeout`` s, default the client's) for the task on every rank.

        Raises ``InvalidTask`` (nothing changed), ``TaskFailed`` (``TaskLost`` when a rank's worker died
        during it, naming the blocks it may have half-written; ``StoreUnavailable`` when the store did not
        answer), ``TaskTimeout``, ``DaemonGone`` or ``RankFailed``.
        """
        if self._result is not None:
            return self._result
        if self._tasks._closed:
            raise TaskFailed(
                f"instance {self._tasks.instance!r}: this CacheTasks was closed before the {self._op.name} task's "
                "result was read, so whether it ran is unknown; read results before close()"
            )
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        replies = []
        for sent in self._parts:
            part = sent
            for _ in range(MAX_RESENDS):
                rank, status, body = self._reply(part, deadline)
                if status != Status.NOT_RUN:
                    break
                # The worker hands its rank over and did not run it: the next daemon does.
                part = self._tasks._resend(rank, deadline, self._op, part)
            replies.append((rank, status, body))
        for rank, status, body in replies:
            if status == Status.INVALID:
                raise InvalidTask(str(body.get("field")), f"rank {rank}: {body.get('message')}")
            if status != Status.OK:
                message = f"instance {self._tasks.instance!r} rank {rank}: {body.get('message')}"
                raise StoreUnavailable(message) if body.get("store_unavailable") else TaskFailed(message)
        self._result = TaskResult(
            ranks=tuple(rank for rank, _, _ in replies),
            blocks=min(int(body["blocks"]) for _, _, body in replies),
            bytes=min(int(body["bytes"]) for _, _, body in replies),
            seconds=max(int(body["ns"]) for _, _, body in replies) / 1e9,
        )
        return self._result

    def _reply(self, part: _Part, deadline: float) -> tuple[int, int, dict[str, Any]]:
        channel = part.channel
        try:
            return (channel.rank, *channel.wait(part.task_id, deadline))
        except TimeoutError:
            raise TaskTimeout(
                f"instance {self._tasks.instance!r} rank {channel.rank}: no reply within the timeout; "
                "the task may still complete"
            ) from None
        except _Closed:
            if self._tasks._handed_over(channel):  # it answers every task it ran before it closes
                return channel.rank, Status.NOT_RUN, {"message": "closed unanswered by a daemon handing over"}
            raise self._tasks._lost(channel.rank, self._op, part.targets, channel) from None


class CacheTasks:
    """A client of one daemon instance's task sockets (``instance`` None: ``$KVCACHED_INSTANCE``, else
    ``default``). Close it (or use ``with``) when done."""

    def __init__(self, instance: str | None = None, *, timeout: float = 60.0) -> None:
        self.instance = instance_or_default(instance)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise InvalidTask("timeout", f"must be a number of seconds > 0, got {timeout!r}")
        self.timeout = float(timeout)
        view = open_instance(self.instance)
        if view is None or view.header is None:
            if view is not None:
                view.close()
            raise DaemonGone(f"instance {self.instance!r}: no daemon is running")
        if not view.alive:
            view.close()
            raise DaemonGone(f"instance {self.instance!r}: daemon pid {view.header.daemon_pid} is not running")
        self._block = view.block
        self._header: Header = view.header
        self._channels: dict[int, _Channel] = {}
        self._lock = threading.Lock()
        self._follow_lock = threading.Lock()
        self._closed = False
        self._old_blocks: list[ControlBlock] = []  # blocks of daemons followed away from, unmapped at close
        self._old_channels: list[_Channel] = []  # and their connections, closed at close
        #: The memory each rank's record named when this client first saw it READY: the same must be
        #: published by any daemon this client follows.
        self._memory: dict[int, tuple[str, dict[str, Any], str]] = {}
        for rank in range(view.header.num_ranks):
            try:
                record = view.block.read(rank)
            except TornRead:
                continue
            if record.state is State.READY and record.generation == view.header.generation:
                self._memory[rank] = (record.backend, record.descriptor, record.cpu_name)

    @property
    def num_ranks(self) -> int:
        """Ranks of the instance."""
        return self._header.num_ranks

    # -- public ---------------------------------------------------------------------------------------

    @overload
    def swap_out(
        self,
        rank: int | None,
        device_block_ids: Sequence[int],
        cpu_block_ids: Sequence[int],
        *,
        keys: Sequence[bytes] | None = None,
        wait: Literal[True] = ...,
        timeout: float | None = ...,
    ) -> TaskResult: ...

    @overload
    def swap_out(
        self,
        rank: int | None,
        device_block_ids: Sequence[int],
        cpu_block_ids: Sequence[int],
        *,
        keys: Sequence[bytes] | None = None,
        wait: Literal[False],
        timeout: float | None = ...,
    ) -> TaskHandle: ...

    def swap_out(
        self,
        rank: int | None,
        device_block_ids: Sequence[int],
        cpu_block_ids: Sequence[int],
        *,
        keys: Sequence[bytes] | None = None,
        wait: bool = True,
        timeout: float | None = None,
    ) -> TaskResult | TaskHandle:
        """Copy device blocks to CPU pool blocks (all layers) on ``rank`` (None: every rank).

        With ``keys`` (one per block, from ``block_keys``) the blocks are also written to the attention
        store (write-through). Returns a ``TaskResult``, or with ``wait=False`` a ``TaskHandle``.
        """
        src = self._ids(device_block_ids, "device_block_ids")
        dst = self._ids(cpu_block_ids, "cpu_block_ids")
        self._same_length(src, dst)
        payload, flags = pack_ids(src, dst), 0
        if keys is not None:
            payload += self._keys(keys, len(src))
            flags = FLAG_KEYS
        return self._submit(Op.SWAP_OUT, rank, payload, flags=flags, wait=wait, timeout=timeout, targets=dst)

    @overload
    def swap_in(
        self,
        rank: int | None,
        cpu_block_ids: Sequence[int],
        device_block_ids: Sequence[int],
        *,
        wait: Literal[True] = ...,
        timeout: float | None = ...,
    ) -> TaskResult: ...

    @overload
    def swap_in(
        self,
        rank: int | None,
        cpu_block_ids: Sequence[int],
        device_block_ids: Sequence[int],
        *,
        wait: Literal[False],
        timeout: float | None = ...,
    ) -> TaskHandle: ...

    def swap_in(
        self,
        rank: int | None,
        cpu_block_ids: Sequence[int],
        device_block_ids: Sequence[int],
        *,
        wait: bool = True,
        timeout: float | None = None,
    ) -> TaskResult | TaskHandle:
        """Copy CPU pool blocks to device blocks (all layers) on ``rank`` (None: every rank)."""
        src = self._ids(cpu_block_ids, "cpu_block_ids")
        dst = self._ids(device_block_ids, "device_block_ids")
        self._same_length(src, dst)
        return self._submit(Op.SWAP_IN, rank, pack_ids(src, dst), wait=wait, timeout=timeout, targets=dst)

    @overload
    def store(
        self,
        rank: int | None,
        device_block_ids: Sequence[int],
        keys: Sequence[bytes],
        *,
        wait: Literal[True] = ...,
        timeout: float | None = ...,
    ) -> TaskResult: ...

    @overload
    def store(
        self,
        rank: int | None,
        device_block_ids: Sequence[int],
        keys: Sequence[bytes],
        *,
        wait: Literal[False],
        timeout: float | None = ...,
    ) -> TaskHandle: ...

    def store(
        self,
        rank: int | None,
        device_block_ids: Sequence[int],
        keys: Sequence[bytes],
        *,
        wait: bool = True,
        timeout: float | None = None,
    ) -> TaskResult | TaskHandle:
        """Write device blocks (all layers) to the attention store under ``keys`` (from ``block_keys``).

        A key already stored is left as it is (a key names its content). ``TaskResult.bytes`` counts the
        bytes newly written.
        """
        ids = self._ids(device_block_ids, "device_block_ids")
        payload = ids.astype("<i4").tobytes() + self._keys(keys, len(ids))
        return self._submit(Op.STORE, rank, payload, wait=wait, timeout=timeout)

    @overload
    def load(
        self,
        rank: int | None,
        keys: Sequence[bytes],
        device_block_ids: Sequence[int],
        *,
        wait: Literal[True] = ...,
        timeout: float | None = ...,
    ) -> TaskResult: ...

    @overload
    def load(
        self,
        rank: int | None,
        keys: Sequence[bytes],
        device_block_ids: Sequence[int],
        *,
        wait: Literal[False],
        timeout: float | None = ...,
    ) -> TaskHandle: ...

    def load(
        self,
        rank: int | None,
        keys: Sequence[bytes],
        device_block_ids: Sequence[int],
        *,
        wait: bool = True,
        timeout: float | None = None,
    ) -> TaskResult | TaskHandle:
        """Read the longest stored prefix of ``keys`` into ``device_block_ids`` (all layers).

        Stops at the first key that is absent or fails verification; ``TaskResult.blocks`` says how many
        leading blocks were loaded, each verified (with ``rank=None``, the fewest of any rank). Target
        blocks past that may hold bytes of the load (they were handed over as receivers): use only the
        first ``blocks``. No block outside ``device_block_ids`` changes.
        """
        ids = self._ids(device_block_ids, "device_block_ids")
        payload = ids.astype("<i4").tobytes() + self._keys(keys, len(ids))
        return self._submit(Op.LOAD, rank, payload, wait=wait, timeout=timeout, targets=ids)

    def lookup(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """How many leading ``keys`` the store holds for every rank of the instance.

        A prefix that only some ranks have is not a hit: the answer is the minimum over ranks.
        """
        payload = self._keys(keys, None)
        result = self._submit(Op.LOOKUP, None, payload, wait=True, timeout=timeout)
        assert isinstance(result, TaskResult)
        return result.blocks

    def close(self) -> None:
        """Close every connection and unmap the control block. Idempotent; later calls raise ``InvalidTask``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for channel in (*self._channels.values(), *self._old_channels):
                channel.close()
            self._channels.clear()
        for block in (*self._old_blocks, self._block):
            block.close()

    def __enter__(self) -> CacheTasks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------------

    def _ids(self, ids: Sequence[int], field: str) -> np.ndarray[Any, Any]:
        if isinstance(ids, list) and len(ids) <= 64 and all(type(i) is int and 0 <= i <= _INT32_MAX for i in ids):
            return np.array(ids, dtype=np.int64)  # the common small batch: one numpy call
        array = np.asarray(ids)
        if array.size == 0:
            return np.zeros(0, dtype=np.int64)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise InvalidTask(field, f"must be a flat list of integers, got {array.dtype} of shape {array.shape}")
        if array.min() < 0 or array.max() > _INT32_MAX:
            bad = array[(array < 0) | (array > _INT32_MAX)][0]
            raise InvalidTask(field, f"id {bad} out of range: block ids are >= 0")
        return array.astype(np.int64, copy=False)

    def _ranks(self, rank: int | None) -> list[int]:
        if rank is None:
            return list(range(self.num_ranks))
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise InvalidTask(
                "rank", f"must be None or 0..{self.num_ranks - 1} (ranks of {self.instance!r}), got {rank!r}"
            )
        return [rank]

    def _check_ready(self, rank: int, deadline: float) -> None:
        """Before a rank's connection opens: the daemon is alive and the rank READY in its generation, on the
        memory this client knows. A rank whose worker is being replaced or reopens adopted memory
        (RECOVERING: its memory is intact), or whose daemon has just published its block (EMPTY), is waited
        for until ``deadline``; a daemon that handed over (KEPT) or died with the rank whole is
        followed to the next one (``_follow``); any other state is refused. Later tasks need no check: a
        worker that answers is alive."""
        while True:
            header = self._header
            alive = is_alive(header.daemon_pid, header.daemon_start)
            try:
                record = self._block.read(rank)
            except TornRead:
                record = None  # a record mid-update: look again
            if record is not None:
                if alive and record.state is State.READY and record.generation == header.generation:
                    self._check_memory(rank, record)
                    return
                if record.state is State.FAILED:
                    raise RankFailed(f"instance {self.instance!r} rank {rank}: {record.error}")
                if record.state is State.KEPT or (not alive and record.state in (State.READY, State.RECOVERING)):
                    self._follow(header, deadline)
                    continue
            if not alive:
                raise DaemonGone(f"instance {self.instance!r}: daemon pid {header.daemon_pid} is gone")
            if record is not None and record.state not in (State.RECOVERING, State.EMPTY):
                raise InvalidTask("rank", f"rank {rank} of {self.instance!r} is {record.state.name}, not READY")
            if time.monotonic() >= deadline:
                state = record.state.name if record is not None else "being written"
                raise TaskTimeout(f"instance {self.instance!r} rank {rank}: still {state}, not READY")
            time.sleep(0.005)

    def _check_memory(self, rank: int, record: Record) -> None:
        """Raise ``DaemonGone`` when ``rank``'s record names other memory than this client first saw."""
        named = (record.backend, record.descriptor, record.cpu_name)
        known = self._memory.setdefault(rank, named)
        if known != named:
            raise DaemonGone(
                f"instance {self.instance!r} rank {rank}: the daemon (generation {record.generation:016x}) made "
                "this rank's memory anew, so the runners' views are not its memory any more: re-attach with "
                "initialize_kv_cache and open a new CacheTasks"
            )

    def _follow(self, old: Header, deadline: float) -> None:
        """The daemon of ``old`` handed over or died: wait (until ``deadline``, at most ``FOLLOW_S`` s) for the
        instance's next live daemon and switch to it when it adopted the memory; raise ``DaemonGone``
        otherwise."""
        began = time.monotonic()
        limit = min(deadline, began + FOLLOW_S)
        with self._follow_lock:
            while self._header is old:
                view = open_instance(self.instance)
                new = view.header if view is not None and view.alive else None
                if view is not None and new is not None and new.generation != old.generation:
                    if new.arena_id != old.arena_id:
                        view.close()
                        raise DaemonGone(
                            f"instance {self.instance!r}: generation {new.generation:016x} replaced generation "
                            f"{old.generation:016x} without adopting its memory ({new.note or 'it allocated anew'}): "
                            "re-attach with initialize_kv_cache and open a new CacheTasks"
                        )
                    with self._lock:  # a task of another thread may still wait on an old connection
                        self._old_channels += self._channels.values()
                        self._channels.clear()
                        self._old_blocks.append(self._block)
                        self._block, self._header = view.block, new
                    return
                if view is not None:
                    view.close()
                if time.monotonic() >= limit:
                    raise DaemonGone(
                        f"instance {self.instance!r}: daemon pid {old.daemon_pid} (generation {old.generation:016x}) "
                        f"stopped, and no daemon took its memory over within {limit - began:.1f}s; "
                        "start one with `kvcached start`"
                    )
                time.sleep(0.01)

    def _channel(self, rank: int, deadline: float) -> _Channel:
        with self._lock:
            channel = self._channels.get(rank)
            if channel is not None:
                return channel
        path = str(task_socket_path(self._header.run_dir, self.instance, rank))
        while True:
            self._check_ready(rank, deadline)
            try:
                channel = _Channel(path, rank, self._block, self.timeout)
            except (AccessDenied, TaskFailed):
                raise
            except (OSError, _Closed):  # the worker is being replaced: its socket comes back with it
                if time.monotonic() >= deadline:
                    raise self._lost(rank, Op.HELLO, (), None) from None
                time.sleep(0.005)
                continue
            with self._lock:
                self._channels[rank] = channel
            return channel

    def _handed_over(self, channel: _Channel) -> bool:
        """Whether the daemon ``channel`` was opened to has handed its rank over (KEPT)."""
        try:
            return channel.block.read(channel.rank).state is State.KEPT
        except TornRead:
            return False

    def _retire(self, rank: int, channel: _Channel) -> None:
        """Close ``channel`` and forget it, if it is still ``rank``'s (a newer one is left alone)."""
        with self._lock:
            if self._channels.get(rank) is channel:
                del self._channels[rank]
        channel.close()

    def _lost(self, rank: int, op: Op, targets: tuple[int, ...], channel: _Channel | None) -> Exception:
        """The error for a task whose connection (``channel``) ended: the daemon died or handed over, the
        rank failed, or its worker died (and is being replaced) during the task."""
        if channel is not None:
            self._retire(rank, channel)
        header = self._header
        alive = is_alive(header.daemon_pid, header.daemon_start)
        try:
            record = self._block.read(rank)
        except TornRead:
            record = None
        if record is not None and record.state is State.FAILED:
            return RankFailed(f"instance {self.instance!r} rank {rank}: {record.error}")
        handed_over = record is not None and record.state is State.KEPT
        if op is Op.HELLO:
            why = "is gone" if not alive else "cannot be reached on its task socket"
            return DaemonGone(f"instance {self.instance!r} rank {rank}: the daemon's worker {why}")
        undefined = (
            f"its target {('CPU' if op is Op.SWAP_OUT else 'device')} blocks {list(targets)} are undefined"
            if targets
            else "nothing it wrote is half-done (store objects are whole or absent)"
        )
        if not alive or handed_over:
            what = "handed its memory over (kvcached restart or stop --keep)" if handed_over else "died"
            return TaskLost(
                f"instance {self.instance!r} rank {rank}: the daemon {what} during the {op.name} task; {undefined}. "
                "Later tasks go to the daemon that adopts the memory.",
                rank=rank,
                blocks=targets,
            )
        return TaskLost(
            f"instance {self.instance!r} rank {rank}: the worker died during the {op.name} task and is being "
            f"replaced on the same memory; {undefined}. Later tasks are served.",
            rank=rank,
            blocks=targets,
        )

    @staticmethod
    def _same_length(src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any]) -> None:
        if len(src) != len(dst):
            raise InvalidTask("block_ids", f"lists of different lengths: {len(src)} and {len(dst)}")

    @staticmethod
    def _keys(keys: Sequence[bytes], count: int | None) -> bytes:
        if isinstance(keys, (bytes, str)):
            raise InvalidTask("keys", "must be a list of keys (from runner_client.block_keys), not one bytes object")
        keys = list(keys)
        if count is not None and len(keys) != count:
            raise InvalidTask("keys", f"{len(keys)} keys for {count} blocks: one key per block")
        for i, key in enumerate(keys):
            if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                raise InvalidTask(
                    "keys", f"key {i} must be {KEY_BYTES} bytes from runner_client.block_keys, got {key!r:.40}"
                )
        return b"".join(keys)

    def _submit(
        self,
        op: Op,
        rank: int | None,
        payload: bytes,
        *,
        flags: int = 0,
        wait: bool,
        timeout: float | None,
        targets: np.ndarray[Any, Any] | None = None,
    ) -> TaskResult | TaskHandle:
        if self._closed:
            raise InvalidTask("tasks", f"this CacheTasks of {self.instance!r} is closed; open a new one")
        if (refused := too_large(op, flags, len(payload))) is not None:
            raise InvalidTask(*refused)
        ranks = self._ranks(rank)
        seconds = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        written = tuple(targets.tolist()) if targets is not None else ()
        parts = []
        for r in ranks:
            try:
                parts.append(self._send(r, deadline, op, payload, flags=flags, written=written))
            except TimeoutError:
                with self._lock:
                    self._channels.pop(r, None)
                raise TaskTimeout(
                    f"instance {self.instance!r} rank {r}: the worker took no more tasks within {self.timeout:g}s"
                ) from None
        handle = TaskHandle(self, op, parts, seconds)
        return handle.result() if wait else handle

    def _resend(self, rank: int, deadline: float, op: Op, part: _Part) -> _Part:
        """Send ``part`` again after its worker answered NOT_RUN: its connection is done with."""
        self._retire(rank, part.channel)
        try:
            return self._send(rank, deadline, op, part.payload, flags=part.flags, written=part.targets)
        except TimeoutError:
            raise TaskTimeout(f"instance {self.instance!r} rank {rank}: the next daemon took no task in time") from None

    def _send(
        self, rank: int, deadline: float, op: Op, payload: bytes, *, flags: int, written: tuple[int, ...]
    ) -> _Part:
        """Send the task to ``rank``. A connection found closed before the task went out (its worker was
        replaced since the last task) is opened anew and the task sent there: nothing of it had run."""
        for attempt in range(2):
            channel = self._channel(rank, deadline)  # READY is checked once, when a channel opens
            try:
                return _Part(channel, channel.submit(op, payload, flags), written, payload, flags)
            except _Closed:
                self._retire(rank, channel)
                if attempt:
                    raise self._lost(rank, op, (), None) from None
        raise AssertionError("unreachable")  # pragma: no cover
