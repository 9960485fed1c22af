"""A client's link to one rank: the daemon serving it, the connection to its worker, what to do when that ends.

``Daemons`` is the instance as one client sees it: the control block of the daemon it talks to, and ``follow``, which
moves every rank to the instance's next daemon when that one adopted the memory. A ``RankLink`` owns one rank's side:

* **ready**: before a connection opens, the rank is READY in a live daemon's generation, on the memory this client
  first saw (else ``DaemonGone``: re-attach); RECOVERING or EMPTY is waited for; KEPT, or a dead daemon that left the
  rank whole, is followed to the next daemon;
* **resend**: a task the worker answered NOT_RUN (it was handing its rank over), or whose connection a daemon handing
  over closed unanswered, is sent again, to the next daemon, up to ``MAX_RESENDS`` times;
* **lost**: a connection that ended otherwise is turned into the error it means: ``TaskLost`` naming the blocks the
  task may have half-written, ``RankFailed``, or ``DaemonGone``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from kvcached.protocol.control import ControlBlock, Header, Record, State
from kvcached.protocol.errors import (
    AccessDenied,
    DaemonGone,
    InvalidTask,
    RankFailed,
    TaskFailed,
    TaskLost,
    TaskTimeout,
    TornRead,
)
from kvcached.protocol.instance import InstanceView, open_instance
from kvcached.protocol.messages import Op, Status
from kvcached.protocol.names import task_socket_path
from kvcached.protocol.proc import is_alive
from runner_client.connection import MAX_IN_FLIGHT, AtCapacity, Closed, Connection, Full

#: How long, at most, a task waits for the next daemon after the one it talked to died or handed over.
FOLLOW_S = 10.0
#: Times a task the daemon did not run (NOT_RUN: it was handing over) is sent again.
MAX_RESENDS = 4
#: How long a task whose connection ended waits, at most, for the rank's record to say why (``_settle``).
SETTLE_S = 1.0

#: What names a rank's memory in its record: (device backend, descriptor, CPU pool).
Memory = tuple[str, dict[str, Any], str]


class Daemons:
    """The daemon of ``instance`` a client talks to (``block``, ``header``), and the ones it followed away from: their
    blocks and connections stay until ``close``, as a task of another thread may still read a reply there."""

    def __init__(self, instance: str, view: InstanceView) -> None:
        assert view.header is not None
        self.instance = instance
        self.block: ControlBlock = view.block
        self.header: Header = view.header
        self.closed = False
        self.lock = threading.Lock()
        self._follow_lock = threading.Lock()
        self._old_blocks: list[ControlBlock] = []
        self._old_connections: list[Connection] = []

    def follow(self, old: Header, deadline: float) -> None:
        """The daemon of ``old`` handed over or died: wait (until ``deadline``, at most ``FOLLOW_S`` s) for the
        instance's next live daemon and switch to it if it adopted the memory, else ``DaemonGone``; at once if another
        thread switched."""
        began = time.monotonic()
        limit = min(deadline, began + FOLLOW_S)
        with self._follow_lock:
            while self.header is old:
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
                    with self.lock:
                        self._old_blocks.append(self.block)
                        self.block, self.header = view.block, new
                    return
                if view is not None:
                    view.close()
                if time.monotonic() >= limit:
                    raise DaemonGone(
                        f"instance {self.instance!r}: daemon pid {old.daemon_pid} (generation {old.generation:016x}) "
                        f"stopped, and no daemon took its memory over within {limit - began:.1f}s; "
                        f"start one with `kvcached start --instance {self.instance}` (one of the same "
                        "configuration adopts the memory)"
                    )
                time.sleep(0.01)

    def retire(self, connection: Connection) -> None:
        """Keep ``connection`` (to a daemon followed away from) until ``close`` (closed at once after it)."""
        with self.lock:
            if not self.closed:
                self._old_connections.append(connection)
                return
        connection.close()

    def close(self, close_links: Callable[[], None]) -> None:
        """Mark the client closed, close the old connections, then the links' (``close_links``: after the mark, so
        that one a thread opens meanwhile is closed by that thread: ``RankLink`` checks the mark before it keeps one),
        and unmap every block. Idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
            for connection in self._old_connections:
                connection.close()
        close_links()
        for block in (*self._old_blocks, self.block):
            block.close()


@dataclasses.dataclass(frozen=True, slots=True)
class Sent:
    """One rank's share of a task as sent: connection, task id, the blocks it writes (named by ``TaskLost``), and
    what was sent (to send again when it was not run)."""

    connection: Connection
    task_id: int
    op: Op
    targets: tuple[int, ...]
    payload: bytes
    flags: int


class RankLink:
    """One rank of a ``Daemons``: see the module docstring. Safe to share between threads."""

    def __init__(self, rank: int, daemons: Daemons, timeout: float, memory: Memory | None) -> None:
        self.rank = rank
        self.daemons = daemons
        self.timeout = timeout
        #: What the rank's record named when this client first saw it READY: any daemon followed must publish it.
        self.memory = memory
        self._lock = threading.Lock()
        self._connection: Connection | None = None

    @property
    def instance(self) -> str:
        return self.daemons.instance

    def send(self, op: Op, payload: bytes, flags: int, targets: tuple[int, ...], deadline: float) -> Sent:
        """Send the task (``targets``: the blocks it writes). Raises ``TaskTimeout`` when the worker takes no more
        tasks, and what the READY check and a lost connection raise."""
        try:
            return self._send(op, payload, flags, targets, deadline)
        except TimeoutError:
            raise TaskTimeout(
                f"instance {self.instance!r} rank {self.rank}: the worker took no more tasks within {self.timeout:g}s"
            ) from None

    def reply(self, sent: Sent, deadline: float, resent: Callable[[Sent], None]) -> tuple[int, dict[str, Any]]:
        """The worker's (status, body) for ``sent``, sending it again to the next daemon while the one it went to did
        not run it (NOT_RUN, at most ``MAX_RESENDS`` times; ``resent`` is told of each new ``Sent``, before its reply is
        waited for). Raises ``TaskTimeout``, ``TaskLost``, ``RankFailed`` or ``DaemonGone``."""
        for _ in range(MAX_RESENDS):
            status, body = self._reply(sent, deadline)
            if status != Status.NOT_RUN:
                return status, body
            # The worker hands its rank over and did not run it: the next daemon does.
            self._drop(sent.connection)
            try:
                sent = self._send(sent.op, sent.payload, sent.flags, sent.targets, deadline)
            except TimeoutError:
                raise TaskTimeout(
                    f"instance {self.instance!r} rank {self.rank}: the next daemon took no task in time"
                ) from None
            resent(sent)
        return self._reply(sent, deadline)

    def close(self) -> None:
        with self._lock:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

    def _connect(self, deadline: float) -> Connection:
        """The rank's open connection to the current daemon, opened (after the READY check) if need be; a
        worker at its connection cap is asked again until ``deadline``."""
        with self._lock:
            connection = self._connection
            if connection is not None and connection.block is self.daemons.block:
                return connection
            if connection is not None:  # opened to a daemon followed away from
                self.daemons.retire(connection)
                self._connection = None
        full: TaskFailed | None = None  # the last refusal for want of room
        while True:
            self._check_ready(deadline)
            path = str(task_socket_path(self.daemons.header.run_dir, self.instance, self.rank))
            try:
                connection = Connection(path, self.rank, self.daemons.block, self.timeout, by=deadline)
            except (AccessDenied, TaskFailed):
                raise
            except AtCapacity as exc:  # room comes as its connections close or go idle: asked again
                full = TaskFailed(f"instance {self.instance!r} {exc}; no room within the task's timeout")
                time.sleep(max(0.0, min(0.05, deadline - time.monotonic())))
                continue
            except TimeoutError:  # the worker took the connection and did not answer its HELLO in time
                if time.monotonic() >= deadline:
                    if full is not None:
                        raise full from None
                    raise TaskTimeout(
                        f"instance {self.instance!r} rank {self.rank}: the worker did not answer a new "
                        "connection within the task's timeout"
                    ) from None
                continue
            except (OSError, Closed):  # the worker is being replaced: its socket comes back with it
                if time.monotonic() >= deadline:
                    raise self._lost(Op.HELLO, (), None) from None
                time.sleep(0.005)
                continue
            with self._lock:
                if self.daemons.closed:  # closed while this one opened: it must not outlive the client
                    connection.close()
                    raise self._closed()
                current = self._connection
                if current is not None and current.block is self.daemons.block:
                    connection.close()  # another thread's opened meanwhile: one per rank, no socket left to GC
                    return current
                if current is not None:
                    self.daemons.retire(current)
                self._connection = connection
            return connection

    def _drop(self, connection: Connection) -> None:
        """Close ``connection`` and forget it, if it is still the rank's (a newer one is left alone)."""
        with self._lock:
            if self._connection is connection:
                self._connection = None
        connection.close()

    def _send(self, op: Op, payload: bytes, flags: int, targets: tuple[int, ...], deadline: float) -> Sent:
        """Send on the rank's connection. One found closed before the task went out (its worker was
        replaced since the last task) is opened anew and the task sent there: nothing of it had run."""
        for attempt in range(2):
            connection = self._connect(deadline)  # READY is checked once, when a connection opens
            try:
                return Sent(connection, connection.send(op, payload, flags, by=deadline), op, targets, payload, flags)
            except Closed:
                self._drop(connection)
                if attempt:
                    raise self._lost(op, (), None) from None
            except Full:
                raise TaskTimeout(
                    f"instance {self.instance!r} rank {self.rank}: {MAX_IN_FLIGHT} tasks in flight and no reply "
                    "in time to send another"
                ) from None
            except TimeoutError:
                self._drop(connection)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _reply(self, sent: Sent, deadline: float) -> tuple[int, dict[str, Any]]:
        connection = sent.connection
        try:
            return connection.wait(sent.task_id, deadline)
        except TimeoutError:
            raise TaskTimeout(
                f"instance {self.instance!r} rank {self.rank}: no reply within the timeout; the task may still complete"
            ) from None
        except Closed:
            record = self._record(connection.block)
            if record is not None and record.state is State.KEPT:  # it answers every task it ran before it closes
                return Status.NOT_RUN, {"message": "closed unanswered by a daemon handing over"}
            raise self._lost(sent.op, sent.targets, connection, deadline) from None

    def _check_ready(self, deadline: float) -> None:
        """**ready** (module docstring) until ``deadline``; RECOVERING is a worker being replaced or reopening adopted
        memory, EMPTY a block just published; FAILED raises ``RankFailed``, STOPPING (the daemon releases the cache)
        ``DaemonGone``, another (ALLOCATING) ``InvalidTask``. Later tasks need no check: an answering worker lives."""
        while True:
            header = self.daemons.header
            alive = is_alive(header.daemon_pid, header.daemon_start)
            record = self._record(self.daemons.block)
            if record is not None:
                if alive and record.state is State.READY and record.generation == header.generation:
                    self._check_memory(record)
                    return
                if record.state is State.FAILED:
                    raise RankFailed(f"instance {self.instance!r} rank {self.rank}: {record.error}")
                if record.state is State.KEPT or (not alive and record.state in (State.READY, State.RECOVERING)):
                    self.daemons.follow(header, deadline)
                    continue
            if not alive:
                raise DaemonGone(f"instance {self.instance!r}: daemon pid {header.daemon_pid} is gone")
            if record is not None and record.state is State.STOPPING:
                raise DaemonGone(
                    f"instance {self.instance!r}: the daemon (pid {header.daemon_pid}) is stopping and releasing "
                    f"the cache (kvcached stop): start it again (kvcached start --instance {self.instance}), then "
                    "re-attach with initialize_kv_cache and open a new CacheTasks"
                )
            if record is not None and record.state not in (State.RECOVERING, State.EMPTY):
                raise InvalidTask("rank", f"rank {self.rank} of {self.instance!r} is {record.state.name}, not READY")
            if time.monotonic() >= deadline:
                state = record.state.name if record is not None else "being written"
                raise TaskTimeout(f"instance {self.instance!r} rank {self.rank}: still {state}, not READY")
            time.sleep(0.005)

    def _check_memory(self, record: Record) -> None:
        """Raise ``DaemonGone`` when the record names other memory than this client first saw."""
        named = (record.backend, record.descriptor, record.cpu_name)
        if self.memory is None:
            self.memory = named
        elif self.memory != named:
            raise DaemonGone(
                f"instance {self.instance!r} rank {self.rank}: the daemon (generation {record.generation:016x}) "
                "made this rank's memory anew, so the runners' views are not its memory any more: re-attach "
                "with initialize_kv_cache and open a new CacheTasks"
            )

    def _record(self, block: ControlBlock) -> Record | None:
        try:
            return block.read(self.rank)
        except TornRead:
            return None  # a record mid-update: look again
        except ValueError:  # its mapping released: the client was closed by another thread
            if self.daemons.closed:
                raise self._closed() from None
            raise

    def _closed(self) -> TaskFailed:
        return TaskFailed(
            f"instance {self.instance!r} rank {self.rank}: this CacheTasks was closed while a task was in flight "
            "on another thread, so whether it ran is unknown"
        )

    def _lost(
        self, op: Op, targets: tuple[int, ...], connection: Connection | None, deadline: float = 0.0
    ) -> Exception:
        """The error for a task whose connection ended: the daemon is stopping, handed over or died, the rank failed,
        or its worker died (and is being replaced) during the task."""
        if connection is not None:
            self._drop(connection)
        alive, record = self._settle(connection, deadline)
        if record is not None and record.state is State.FAILED:
            return RankFailed(f"instance {self.instance!r} rank {self.rank}: {record.error}")
        where = f"instance {self.instance!r} rank {self.rank}"
        if op is Op.HELLO and alive:  # the worker is being replaced, under a supervisor that does not run
            return TaskTimeout(f"{where}: the daemon's worker could not be reached on its task socket in time")
        if op is Op.HELLO:
            return DaemonGone(f"{where}: the daemon's worker is gone")
        undefined = (
            f"its target {('CPU' if op is Op.SWAP_OUT else 'device')} blocks {list(targets)} are undefined"
            if targets
            else "nothing it wrote is half-done (store objects are whole or absent)"
        )
        if record is not None and record.state is State.STOPPING:
            why = "the daemon is stopping and releasing the cache (kvcached stop); later tasks raise DaemonGone"
        elif record is not None and record.state is State.KEPT:
            why = "the daemon handed its memory over (kvcached restart, stop --keep); later tasks go to the next one"
        elif not alive:
            why = "the daemon died; later tasks go to the daemon that adopts the memory"
        elif connection is not None and record is not None and record.worker_pid == connection.worker_pid:
            why = "the worker closed the connection (it may be dying, its supervisor not yet told)"
        else:
            why = "the worker died and is being replaced on the same memory; later tasks are served"
        return TaskLost(
            f"{where}: the {op.name} task ended unanswered: {why}. {undefined[0].upper()}{undefined[1:]}.",
            rank=self.rank,
            blocks=targets,
        )

    def _settle(self, connection: Connection | None, deadline: float) -> tuple[bool, Record | None]:
        """Whether the daemon lives, and the rank's record, once they tell what ended ``connection``. The supervisor
        marks a dead worker's rank RECOVERING within milliseconds (its replacement has another pid), but a daemon
        killed with SIGKILL looks alive until the kernel has ended it, and its workers die with it: while the rank
        still reads READY under the worker that held the connection, they are read again for up to ``SETTLE_S``
        (within ``deadline``). Once per connection: the tasks it carried after the first take its verdict."""
        if connection is not None and connection.verdict is not None:
            return connection.verdict
        until = min(time.monotonic() + SETTLE_S, deadline)
        while True:
            header = self.daemons.header
            alive = is_alive(header.daemon_pid, header.daemon_start)
            record = self._record(self.daemons.block)
            unsettled = record is None or (
                connection is not None and record.state is State.READY and record.worker_pid == connection.worker_pid
            )
            if not alive or not unsettled or time.monotonic() >= until:
                if connection is not None:
                    connection.verdict = alive, record
                return alive, record
            time.sleep(0.005)
