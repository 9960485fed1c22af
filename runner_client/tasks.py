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
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal, overload

import numpy as np

from kvcached.protocol.control import Header, State
from kvcached.protocol.errors import (
    AccessDenied,
    DaemonGone,
    InvalidTask,
    RankFailed,
    TaskFailed,
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
)
from kvcached.protocol.names import check_instance, task_socket_path
from kvcached.protocol.proc import is_alive

_INT32_MAX = 2**31 - 1


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


class _Channel:
    """One connection to one rank worker; frames are sent and replies read under ``lock``."""

    def __init__(self, path: str, rank: int, generation: int, timeout: float) -> None:
        self.rank = rank
        self.lock = threading.Lock()
        self.next_id = 1
        self.early: dict[int, tuple[int, dict[str, Any]]] = {}
        self.buf = bytearray()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except PermissionError:
            self.sock.close()
            raise AccessDenied(
                f"rank {rank}: no permission to connect to {path}: the daemon admits its own user and the "
                "members of its --group"
            ) from None
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(True)
        self.rcvtimeo = 0.0
        self._set_rcvtimeo(timeout)
        hello = json.dumps({"generation": f"{generation:016x}"}).encode()
        try:
            task_id = self.submit(Op.HELLO, hello)
        except _Closed:
            # Closed at once: a refused peer gets one REFUSED frame first; wait() raises AccessDenied on it.
            self.wait(0, time.monotonic() + min(timeout, 1.0))
            raise
        status, body = self.wait(task_id, time.monotonic() + timeout)
        if status != Status.OK:
            self.sock.close()
            raise DaemonGone(f"rank {rank}: the daemon's worker refused this client: {body.get('message')}")

    def submit(self, op: Op, payload: bytes, flags: int = 0) -> int:
        with self.lock:
            task_id = self.next_id
            self.next_id += 1
            try:
                self.sock.sendall(request(op, task_id, payload, flags))
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise _Closed() from exc
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
            except ConnectionResetError as exc:
                raise _Closed() from exc
            if not chunk:
                raise _Closed()
            self.buf += chunk
            return

    def _set_rcvtimeo(self, seconds: float) -> None:
        seconds = max(seconds, 0.001)
        whole = int(seconds)
        self.sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", whole, int((seconds - whole) * 1e6))
        )
        self.rcvtimeo = seconds

    def wait(self, task_id: int, deadline: float) -> tuple[int, dict[str, Any]]:
        """The (status, body) of ``task_id``, reading and keeping replies of other tasks on the way."""
        with self.lock:
            while task_id not in self.early:
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
                    raise AccessDenied(f"rank {self.rank}: the daemon refused this client: {body.get('message')}")
                self.early[got_id] = (status, body)
            return self.early.pop(task_id)

    def close(self) -> None:
        self.sock.close()


class TaskHandle:
    """A submitted task; ``result()`` waits for every rank's reply."""

    def __init__(self, tasks: CacheTasks, parts: list[tuple[_Channel, int]], timeout: float) -> None:
        self._tasks = tasks
        self._parts = parts
        self._timeout = timeout
        self._result: TaskResult | None = None

    def result(self, timeout: float | None = None) -> TaskResult:
        """Wait (at most ``timeout`` s, default the client's) for the task on every rank.

        Raises ``InvalidTask`` (nothing changed), ``TaskFailed``, ``TaskTimeout``, ``DaemonGone`` or
        ``RankFailed``. All ranks' replies are collected before an error is raised.
        """
        if self._result is not None:
            return self._result
        deadline = time.monotonic() + (self._timeout if timeout is None else timeout)
        replies = []
        for channel, task_id in self._parts:
            try:
                replies.append((channel.rank, *channel.wait(task_id, deadline)))
            except TimeoutError:
                raise TaskTimeout(
                    f"instance {self._tasks.instance!r} rank {channel.rank}: no reply within the timeout; "
                    "the task may still complete"
                ) from None
            except _Closed:
                raise self._tasks._lost(channel.rank) from None
        for rank, status, body in replies:
            if status == Status.INVALID:
                raise InvalidTask(str(body.get("field")), f"rank {rank}: {body.get('message')}")
            if status != Status.OK:
                raise TaskFailed(f"instance {self._tasks.instance!r} rank {rank}: {body.get('message')}")
        self._result = TaskResult(
            ranks=tuple(rank for rank, _, _ in replies),
            blocks=min(int(body["blocks"]) for _, _, body in replies),
            bytes=min(int(body["bytes"]) for _, _, body in replies),
            seconds=max(int(body["ns"]) for _, _, body in replies) / 1e9,
        )
        return self._result


class CacheTasks:
    """A client of one daemon instance's task sockets. Close it (or use ``with``) when done."""

    def __init__(self, instance: str = "default", *, timeout: float = 60.0) -> None:
        self.instance = check_instance(instance)
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
        self._closed = False

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
        return self._submit(Op.SWAP_OUT, rank, payload, flags=flags, wait=wait, timeout=timeout)

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
        return self._submit(Op.SWAP_IN, rank, pack_ids(src, dst), wait=wait, timeout=timeout)

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
        were loaded (with ``rank=None``, the fewest of any rank). Blocks past that are untouched.
        """
        ids = self._ids(device_block_ids, "device_block_ids")
        payload = ids.astype("<i4").tobytes() + self._keys(keys, len(ids))
        return self._submit(Op.LOAD, rank, payload, wait=wait, timeout=timeout)

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
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
        self._block.close()

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

    def _check_ready(self, rank: int) -> None:
        """Before the first task of a rank: the daemon is alive and the rank READY in its generation.
        Later tasks need no check: a worker that answers is alive, and it dies with its supervisor."""
        header = self._header
        if not is_alive(header.daemon_pid, header.daemon_start):
            raise DaemonGone(f"instance {self.instance!r}: daemon pid {header.daemon_pid} is gone")
        try:
            record = self._block.read(rank)
        except TornRead:
            return  # a record mid-update; the worker itself refuses if it cannot serve
        if record.state is not State.READY or record.generation != header.generation:
            raise InvalidTask("rank", f"rank {rank} of {self.instance!r} is {record.state.name}, not READY")

    def _channel(self, rank: int) -> _Channel:
        with self._lock:
            channel = self._channels.get(rank)
            if channel is not None:
                return channel
            self._check_ready(rank)
            path = str(task_socket_path(self._header.run_dir, self.instance, rank))
            try:
                channel = _Channel(path, rank, self._header.generation, self.timeout)
            except AccessDenied:
                raise
            except (OSError, _Closed):
                channel = None  # _lost() takes the lock itself
            else:
                self._channels[rank] = channel
                return channel
        raise self._lost(rank)

    def _lost(self, rank: int) -> Exception:
        """The error for a rank whose connection ended: which of the daemon or the rank failed."""
        with self._lock:
            channel = self._channels.pop(rank, None)
        if channel is not None:
            channel.close()
        header = self._header
        if not is_alive(header.daemon_pid, header.daemon_start):
            return DaemonGone(f"instance {self.instance!r}: daemon pid {header.daemon_pid} died during the task")
        try:
            record = self._block.read(rank)
        except TornRead:
            record = None
        if record is not None and record.state is State.FAILED:
            return RankFailed(f"instance {self.instance!r} rank {rank}: {record.error}")
        state = record.state.name if record is not None else "unknown"
        return DaemonGone(f"instance {self.instance!r} rank {rank}: connection to the worker lost (state {state})")

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
        self, op: Op, rank: int | None, payload: bytes, *, flags: int = 0, wait: bool, timeout: float | None
    ) -> TaskResult | TaskHandle:
        if self._closed:
            raise InvalidTask("tasks", f"this CacheTasks of {self.instance!r} is closed; open a new one")
        ranks = self._ranks(rank)
        channels = [self._channel(r) for r in ranks]  # READY is checked once, when a channel opens
        parts = []
        for r, channel in zip(ranks, channels, strict=True):
            try:
                parts.append((channel, channel.submit(op, payload, flags)))
            except _Closed:
                raise self._lost(r) from None
        handle = TaskHandle(self, parts, self.timeout if timeout is None else timeout)
        return handle.result() if wait else handle
