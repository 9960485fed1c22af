"""Ask the daemon to move blocks: ``CacheTasks`` talks to each rank worker over its task socket.

    with runner_client.CacheTasks(instance="default") as tasks:
        tasks.swap_out(rank, device_block_ids=[4, 5, 6], cpu_block_ids=[0, 1, 2])   # device -> CPU pool
        tasks.swap_in(None, cpu_block_ids=[0, 1, 2], device_block_ids=[7, 8, 9])    # every rank, together
        handle = tasks.submit(tasks.swap_out, 0, [1], [3])     # returns once sent: pipeline, then
        handle.result(timeout=5)

        tasks.store(None, [4, 5], keys[:2])                     # device -> attention store, every rank
        n = tasks.lookup(keys)                                  # leading keys stored for every rank
        tasks.load(None, keys[:n], [9, 10][:n])                 # store -> device

Each call moves whole blocks: every layer's key, value and scale. ``rank=None`` sends the task to every rank of the
instance and returns when all have finished (a tensor-parallel group swaps together). The task methods block until the
task is done and return a ``TaskResult``; ``submit`` sends one of them and returns a ``TaskHandle`` at once. A task the
daemon refuses raises ``InvalidTask`` naming the field, and no block has changed on any rank. One connection per rank,
opened on first use; replies arrive in order, so one ``CacheTasks`` may be shared by threads.

A daemon restarted (``kvcached restart``), stopped with ``--keep`` or killed, whose memory the instance's next daemon
adopts, is followed (``runner_client.link``): a task in flight then fails with ``TaskLost`` (naming the blocks it may
have half-written); later tasks wait for the next daemon, within their timeout and at most ``FOLLOW_S`` seconds, and go
to it. When the next daemon made the memory anew (it did not adopt it, or the device tier cannot outlive its process),
tasks raise ``DaemonGone``: re-attach with ``initialize_kv_cache`` and open a new ``CacheTasks``.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec

import numpy as np

from kvcached.protocol.control import State
from kvcached.protocol.errors import (
    DaemonGone,
    InvalidArgument,
    InvalidTask,
    StoreUnavailable,
    TaskFailed,
    TaskTimeout,
    different_lengths,
)
from kvcached.protocol.instance import InstanceView, open_instance
from kvcached.protocol.messages import FLAG_KEYS, KEY_BYTES, Op, Status, pack_ids, too_large
from kvcached.protocol.names import instance_or_default
from runner_client.connection import MAX_IN_FLIGHT
from runner_client.link import FOLLOW_S, MAX_RESENDS, Daemons, Memory, RankLink, Sent

__all__ = ["FOLLOW_S", "MAX_IN_FLIGHT", "MAX_RESENDS", "CacheTasks", "TaskHandle", "TaskResult"]

_INT32_MAX = 2**31 - 1
#: The longest timeout taken (about three years): longer ones overflow the clocks a wait uses.
MAX_TIMEOUT_S = 1e8
P = ParamSpec("P")
#: The task methods ``submit`` takes.
_SUBMITTABLE = ("swap_out", "swap_in", "store", "load")


@dataclasses.dataclass(frozen=True, slots=True)
class TaskResult:
    """What a finished task did: the ranks involved, blocks and bytes per rank (the fewest of any rank:
    a load may stop early on one rank), and the slowest rank's time."""

    ranks: tuple[int, ...]
    blocks: int
    bytes: int
    seconds: float


@dataclasses.dataclass(frozen=True, slots=True)
class _Task:
    """A task checked on this side, ready to send."""

    op: Op
    rank: int | None
    payload: bytes
    flags: int = 0
    targets: tuple[int, ...] = ()
    timeout: float | None = None


class TaskHandle:
    """A submitted task; ``result()`` waits for every rank's reply (from any number of threads at once: one reads the
    replies, the others wait for it and get the same outcome). A handle dropped before every reply was read tells the
    connections to drop those replies instead of keeping them."""

    def __init__(self, daemons: Daemons, op: Op, parts: list[tuple[RankLink, Sent]], timeout: float) -> None:
        self._daemons = daemons
        self._op = op
        self._parts = parts
        self._timeout = timeout
        self._result: TaskResult | None = None
        self._replies: dict[int, tuple[int, dict[str, Any]]] = {}  # by part, as read
        self._reading = threading.Lock()  # held by the thread that reads the replies

    def __copy__(self) -> TaskHandle:
        return self  # one task, one handle: a copy dropped must not drop the replies the original waits for

    def __deepcopy__(self, memo: dict[int, Any]) -> TaskHandle:
        return self

    def _resent(self, part: int, link: RankLink, sent: Sent) -> None:
        self._parts[part] = (link, sent)

    def __del__(self) -> None:
        for i, (_, sent) in enumerate(getattr(self, "_parts", ())):
            if i not in self._replies:
                sent.connection.forget(sent.task_id)

    def result(self, timeout: float | None = None) -> TaskResult:
        """Wait (at most ``timeout`` s, default the task's) for the task on every rank. Raises ``InvalidTask``
        (nothing changed), ``TaskFailed`` (``TaskLost`` when a rank's worker died during it, naming the blocks it may
        have half-written; ``StoreUnavailable`` for a silent store), ``TaskTimeout``, ``DaemonGone``, ``RankFailed``."""
        if self._result is not None:
            return self._result
        instance = self._daemons.instance
        if self._daemons.closed:
            raise TaskFailed(
                f"instance {instance!r}: this CacheTasks was closed before the {self._op.name} task's "
                "result was read, so whether it ran is unknown; read results before close()"
            )
        deadline = time.monotonic() + (self._timeout if timeout is None else _seconds(timeout, poll=True))
        if not self._reading.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TaskTimeout(
                f"instance {instance!r}: no reply within the timeout (another thread still waits for this "
                f"{self._op.name} task); the task may still complete"
            )
        try:
            return self._read(deadline)
        finally:
            self._reading.release()

    def _read(self, deadline: float) -> TaskResult:
        """``result()`` in the one thread that reads the replies (the first outcome is every caller's)."""
        if self._result is not None:
            return self._result
        for i, (link, sent) in enumerate(self._parts):
            if i not in self._replies:  # a part sent again is the handle's from then on (a retry, ``__del__``)
                self._replies[i] = link.reply(sent, deadline, functools.partial(self._resent, i, link))
        replies = [(link.rank, *self._replies[i]) for i, (link, _) in enumerate(self._parts)]
        for rank, status, body in replies:
            if status == Status.INVALID:
                raise InvalidTask(str(body.get("field")), f"rank {rank}: {body.get('message')}")
            if status != Status.OK:
                message = f"instance {self._daemons.instance!r} rank {rank}: {body.get('message')}"
                raise StoreUnavailable(message) if body.get("store_unavailable") else TaskFailed(message)
        self._result = TaskResult(
            ranks=tuple(rank for rank, _, _ in replies),
            blocks=min(int(body["blocks"]) for _, _, body in replies),
            bytes=min(int(body["bytes"]) for _, _, body in replies),
            seconds=max(int(body["ns"]) for _, _, body in replies) / 1e9,
        )
        return self._result


class CacheTasks:
    """A client of one daemon instance's task sockets (``instance`` None: ``$KVCACHED_INSTANCE``, else
    ``default``). Close it (or use ``with``) when done. ``timeout``: seconds a task may take, by default."""

    def __init__(self, instance: str | None = None, *, timeout: float = 60.0) -> None:
        self.instance = instance_or_default(instance)
        self.timeout = _seconds(timeout)
        view = open_instance(self.instance)
        if view is None or view.header is None:
            if view is not None:
                view.close()
            raise DaemonGone(
                f"instance {self.instance!r}: no daemon is running: start one (kvcached start --instance "
                f"{self.instance}), then open a CacheTasks"
            )
        if not view.alive:
            view.close()
            raise DaemonGone(
                f"instance {self.instance!r}: daemon pid {view.header.daemon_pid} is not running (stopped with "
                f"--keep, or killed: its memory waits for the next `kvcached start --instance {self.instance}` to "
                "adopt it); open a CacheTasks once it runs (one opened before follows the next daemon by itself)"
            )
        self._daemons = Daemons(self.instance, view)
        self._links = [
            RankLink(rank, self._daemons, self.timeout, _ready_memory(view, rank))
            for rank in range(view.header.num_ranks)
        ]

    @property
    def num_ranks(self) -> int:
        """Ranks of the instance."""
        return self._daemons.header.num_ranks

    def swap_out(
        self,
        rank: int | None,
        device_block_ids: Sequence[int],
        cpu_block_ids: Sequence[int],
        *,
        keys: Sequence[bytes] | None = None,
        timeout: float | None = None,
    ) -> TaskResult:
        """Copy device blocks to CPU pool blocks (all layers) on ``rank`` (None: every rank); with ``keys`` (one per
        block, from ``block_keys``) also to the attention store (write-through)."""
        return self._send(self._swap_out(rank, device_block_ids, cpu_block_ids, keys=keys, timeout=timeout)).result()

    def swap_in(
        self,
        rank: int | None,
        cpu_block_ids: Sequence[int],
        device_block_ids: Sequence[int],
        *,
        timeout: float | None = None,
    ) -> TaskResult:
        """Copy CPU pool blocks to device blocks (all layers) on ``rank`` (None: every rank)."""
        return self._send(self._swap_in(rank, cpu_block_ids, device_block_ids, timeout=timeout)).result()

    def store(
        self, rank: int | None, device_block_ids: Sequence[int], keys: Sequence[bytes], *, timeout: float | None = None
    ) -> TaskResult:
        """Write device blocks (all layers) to the attention store under ``keys`` (from ``block_keys``). A key already
        stored is left as it is (a key names its content); ``TaskResult.bytes`` counts the bytes newly written. Raises
        ``StoreUnavailable`` (a ``TaskFailed``): its backend is unreachable or did not answer in ``--store-timeout``."""
        return self._send(self._store(rank, device_block_ids, keys, timeout=timeout)).result()

    def load(
        self, rank: int | None, keys: Sequence[bytes], device_block_ids: Sequence[int], *, timeout: float | None = None
    ) -> TaskResult:
        """Read the longest stored prefix of ``keys`` into ``device_block_ids`` (all layers): it stops at the first key
        absent or failing verification, and ``TaskResult.blocks`` says how many leading blocks were loaded, each
        verified (with ``rank=None``, the fewest of any rank). Target blocks past that may hold bytes of the load (they
        were handed over as receivers): use only the first ``blocks``. No block outside ``device_block_ids`` changes.
        Raises ``StoreUnavailable`` (a ``TaskFailed``): the store's backend is unreachable or did not answer in time."""
        return self._send(self._load(rank, keys, device_block_ids, timeout=timeout)).result()

    def lookup(self, keys: Sequence[bytes], *, timeout: float | None = None) -> int:
        """How many leading ``keys`` the store holds for every rank of the instance (a prefix only some ranks have is
        not a hit: the minimum over ranks). Raises ``StoreUnavailable`` (a ``TaskFailed``) when a rank's store cannot
        be reached or did not answer in time."""
        return self._send(_Task(Op.LOOKUP, None, _keys(keys, None), timeout=timeout)).result().blocks

    def submit(self, task: Callable[P, TaskResult], /, *args: P.args, **kwargs: P.kwargs) -> TaskHandle:
        """Send ``task`` (this client's ``swap_out``, ``swap_in``, ``store`` or ``load``, with its arguments) and return
        its ``TaskHandle`` at once, without waiting for the reply: tasks submitted one after another are pipelined.
        What the client can check (a rank, lists of different lengths, keys) raises ``InvalidTask`` here; what the
        daemon checks (ids against its pool sizes, a repeated target) comes from ``result()``, as the blocking call
        would have raised it, nothing moved::

            handles = [tasks.submit(tasks.swap_out, None, [i], [i]) for i in range(4)]
            results = [handle.result() for handle in handles]
        """
        name = getattr(task, "__name__", None)
        mine = getattr(task, "__self__", None) is self
        if not mine or name not in _SUBMITTABLE:
            raise InvalidArgument(
                "task", f"must be one of this CacheTasks' methods {', '.join(_SUBMITTABLE)}; got {task!r}"
            )
        build: Callable[..., _Task] = getattr(self, f"_{name}")
        return self._send(build(*args, **kwargs))

    def close(self) -> None:
        """Close every connection and unmap the control block. Idempotent; later calls raise ``InvalidTask``."""
        self._daemons.close(self._close_links)

    def _close_links(self) -> None:
        for link in self._links:
            link.close()

    def __enter__(self) -> CacheTasks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _swap_out(
        self,
        rank: int | None,
        device_block_ids: Sequence[int],
        cpu_block_ids: Sequence[int],
        *,
        keys: Sequence[bytes] | None = None,
        timeout: float | None = None,
    ) -> _Task:
        src = self._ids(device_block_ids, "device_block_ids")
        dst = self._ids(cpu_block_ids, "cpu_block_ids")
        _same_length(src, dst, "device_block_ids", "cpu_block_ids")
        payload, flags = pack_ids(src, dst), 0
        if keys is not None:
            payload += _keys(keys, len(src))
            flags = FLAG_KEYS
        return _Task(Op.SWAP_OUT, rank, payload, flags, tuple(dst.tolist()), timeout)

    def _swap_in(
        self,
        rank: int | None,
        cpu_block_ids: Sequence[int],
        device_block_ids: Sequence[int],
        *,
        timeout: float | None = None,
    ) -> _Task:
        src = self._ids(cpu_block_ids, "cpu_block_ids")
        dst = self._ids(device_block_ids, "device_block_ids")
        _same_length(src, dst, "cpu_block_ids", "device_block_ids")
        return _Task(Op.SWAP_IN, rank, pack_ids(src, dst), 0, tuple(dst.tolist()), timeout)

    def _store(
        self, rank: int | None, device_block_ids: Sequence[int], keys: Sequence[bytes], *, timeout: float | None = None
    ) -> _Task:
        ids = self._ids(device_block_ids, "device_block_ids")
        return _Task(Op.STORE, rank, ids.astype("<i4").tobytes() + _keys(keys, len(ids)), timeout=timeout)

    def _load(
        self, rank: int | None, keys: Sequence[bytes], device_block_ids: Sequence[int], *, timeout: float | None = None
    ) -> _Task:
        ids = self._ids(device_block_ids, "device_block_ids")
        payload = ids.astype("<i4").tobytes() + _keys(keys, len(ids))
        return _Task(Op.LOAD, rank, payload, 0, tuple(ids.tolist()), timeout)

    def _send(self, task: _Task) -> TaskHandle:
        if self._daemons.closed:
            raise InvalidTask("tasks", f"this CacheTasks of {self.instance!r} is closed; open a new one")
        if (refused := too_large(task.op, task.flags, len(task.payload))) is not None:
            raise InvalidTask(*refused)
        links = self._ranks(task.rank)
        seconds = self.timeout if task.timeout is None else _seconds(task.timeout)
        deadline = time.monotonic() + seconds
        parts = [(link, link.send(task.op, task.payload, task.flags, task.targets, deadline)) for link in links]
        return TaskHandle(self._daemons, task.op, parts, seconds)

    def _ranks(self, rank: int | None) -> list[RankLink]:
        if rank is None:
            return list(self._links)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise InvalidTask(
                "rank", f"must be None or 0..{self.num_ranks - 1} (ranks of {self.instance!r}), got {rank!r}"
            )
        return [self._links[rank]]

    @staticmethod
    def _ids(ids: Sequence[int], field: str) -> np.ndarray[Any, Any]:
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


def _seconds(timeout: object, *, poll: bool = False) -> float:
    """A timeout argument as seconds; ``InvalidArgument`` unless it is a number in (0, ``MAX_TIMEOUT_S``]
    (``poll``: any number up to that, a ``result()`` that looks without waiting)."""
    ok = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not ok or not (timeout <= MAX_TIMEOUT_S and (poll or timeout > 0)):  # type: ignore[operator]
        low = "a number of seconds" if poll else "a number of seconds > 0"
        raise InvalidArgument("timeout", f"must be {low} and <= {MAX_TIMEOUT_S:.0e}, got {timeout!r}")
    return float(timeout)  # type: ignore[arg-type]


def _ready_memory(view: InstanceView, rank: int) -> Memory | None:
    """The memory ``rank``'s record names when it is READY in the view's generation (None otherwise)."""
    record, header = view.record(rank), view.header
    if record is None or header is None or record.state is not State.READY or record.generation != header.generation:
        return None
    return (record.backend, record.descriptor, record.cpu_name)


def _same_length(src: np.ndarray[Any, Any], dst: np.ndarray[Any, Any], src_field: str, dst_field: str) -> None:
    """``InvalidTask`` naming the target list (``dst_field``) unless it has one id per source id."""
    if len(src) != len(dst):
        raise InvalidTask(dst_field, different_lengths(src_field, len(src), dst_field, len(dst)))


def _keys(keys: Sequence[bytes], count: int | None) -> bytes:
    if isinstance(keys, (bytes, str)):
        raise InvalidTask("keys", "must be a list of keys (from runner_client.block_keys), not one bytes object")
    try:
        keys = list(keys)
    except TypeError:
        raise InvalidTask("keys", f"must be a list of keys (from runner_client.block_keys), got {keys!r:.40}") from None
    if count is not None and len(keys) != count:
        raise InvalidTask("keys", f"{len(keys)} keys for {count} blocks: one key per block")
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or len(key) != KEY_BYTES:
            raise InvalidTask(
                "keys", f"key {i} must be {KEY_BYTES} bytes from runner_client.block_keys, got {key!r:.40}"
            )
    return b"".join(keys)
