"""The supervisor's ranks: one object per rank, and the worker processes it forks, watches and stops.

``RankSlot`` holds everything the supervisor knows of one rank (gunicorn's arbiter keeps one object per worker): the
rank's record and semaphore, its worker (``Child``), what that worker is judged by, and whether the rank's memory is
whole; the supervisor walks the slots to reap, judge progress and stop. A slot owns its record's writes (``update``); a
worker is judged by progress, not by silence between tasks: its stats slot's ``progress`` counter must move within the
worker timeout, counted in the supervisor's own waking time (``hung``, ``Supervisor._check_progress``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import socket
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import posix_ipc

from kvcached.access import Access
from kvcached.daemon import channel
from kvcached.logs import Logger
from kvcached.protocol.control import ControlBlock, Record, State
from kvcached.protocol.errors import ProtocolError
from kvcached.protocol.names import SHM_DIR, semaphore_name
from kvcached.protocol.proc import end
from kvcached.protocol.stats import StatsSlot

if TYPE_CHECKING:
    from kvcached.daemon.plan import WorkerPlan

#: A rank whose workers die this many times within the window cannot be brought back.
MAX_REPLACEMENTS = 3
REPLACEMENT_WINDOW_S = 60.0


@dataclasses.dataclass(slots=True, eq=False)
class Child:
    """A rank worker (this image's, or the last one's after a restart) and the supervisor's end of its channel."""

    pid: int
    channel: socket.socket
    #: It said Ready: it serves tasks, and has tasks to finish when told to stop.
    ready: bool = False
    #: It said Prepared (a restart): it has reopened the memory and waits for Serve.
    prepared: bool = False

    def kill(self) -> None:
        """SIGKILL it (the reaper sees it exit)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def exit_status(self) -> int | None:
        """Its wait status once it has exited (reaping it), else None; never blocks."""
        try:
            done, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped already
            return 0
        return status if done else None


@dataclasses.dataclass(slots=True, eq=False)
class RankSlot:
    """One rank as the supervisor holds it."""

    rank: int
    record: Record
    sem: posix_ipc.Semaphore
    worker: Child | None = None
    #: Its memory is whole (adopted, or published READY once): kept unless the operator says otherwise.
    whole: bool = False
    #: The worker's progress counter as last seen, and the waking seconds it has stood still since (-inf once its worker
    #: was killed as hung: the reaper takes it from there).
    seen: int = 0
    still_s: float = 0.0
    #: When its workers died, within the last ``REPLACEMENT_WINDOW_S``.
    deaths: list[float] = dataclasses.field(default_factory=list)

    def update(self, block: ControlBlock, **changes: Any) -> bool:
        """Write the record with ``changes`` under the control block's seqlock; when its state changes, stamp since when
        and post the semaphore (the turnstile runners wait on). Whether the state changed."""
        record = self.record
        changed = bool(changes.get("state", record.state) != record.state)
        for key, value in changes.items():
            setattr(record, key, value)
        if changed:
            record.since_ns = time.monotonic_ns()
            record.since_wall_ns = time.time_ns()
        block.write(self.rank, record)
        if changed:
            self.sem.release()
        return changed

    def hired(self, worker: Child, seen: int) -> None:
        self.worker, self.seen, self.still_s = worker, seen, 0.0

    def heard(self) -> None:
        """Its worker said something: that is progress too."""
        self.still_s = 0.0
        self.record.heartbeat_ns = time.monotonic_ns()

    def progressed(self, seen: int) -> bool:
        if seen == self.seen:
            return False
        self.seen, self.still_s = seen, 0.0
        self.record.heartbeat_ns = time.monotonic_ns()
        return True

    def hung(self, awake_s: float, timeout_s: float) -> str:
        """Count ``awake_s`` more waking seconds without progress; why the worker is hung ("" while not): standing
        still past ``timeout_s`` while READY or RECOVERING (an allocating one sends Progress instead). Said once per
        worker."""
        self.still_s += awake_s
        if self.still_s > timeout_s and self.record.state in (State.READY, State.RECOVERING):
            why = f"no progress for {self.still_s:.1f}s (hung)"
            self.still_s = float("-inf")
            return why
        return ""

    def kill(self, why: str, log: Logger) -> None:
        """SIGKILL its worker, saying why; the reaper replaces it."""
        assert self.worker is not None
        log.error("killing rank worker", rank=self.rank, worker_pid=self.worker.pid, reason=why)
        self.worker.kill()

    def died(self, now: float) -> int:
        """Count a death of its worker at ``now``: how many died within the window, this one included."""
        self.deaths = [t for t in self.deaths if now - t < REPLACEMENT_WINDOW_S] + [now]
        return len(self.deaths)

    def names_memory(self) -> bool:
        """Whether the record names memory the rank's next worker must reopen (it is READY or RECOVERING)."""
        return self.record.state in (State.READY, State.RECOVERING) and bool(self.record.backend)


def fork_worker(plan: WorkerPlan, stats: StatsSlot, *, close: Iterable[int | socket.socket]) -> Child:
    """Fork the worker of ``plan``; in the child, close ``close`` (the supervisor's descriptors and other workers'
    channels) and keep nothing of the supervisor's but its end of the new channel."""
    from kvcached.daemon.worker import worker_main  # here: the CLI imports this module (through handover)

    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        parent_sock.close()
        signal.set_wakeup_fd(-1)
        for thing in close:
            if isinstance(thing, socket.socket):
                thing.close()
            elif thing >= 0:
                os.close(thing)
        worker_main(child_sock, parent=parent, plan=plan, stats=stats)
    child_sock.close()
    return Child(pid, parent_sock)


def stop_children(children: Iterable[Child], *, grace_s: float, drain: bool) -> None:
    """Tell every child to stop and wait for it to exit, killing it after ``grace_s`` seconds; with ``drain`` (a
    handover: the child first answers what clients still send NOT_RUN) wait only until it has closed its channel, and
    ``channel.DRAIN_S`` longer: it is done with every task, and its exit (unmapping gigabytes) need not hold up the next
    daemon (an image executed after this one reaps it). A child that never said Ready (allocating, reopening) is killed
    at once: it has no task to finish, and stopping it changes no byte a start could adopt. Every channel is closed."""
    stopping = list(children)
    for child in stopping:
        with contextlib.suppress(OSError):
            channel.send(child.channel, channel.Stop(drain=drain))
    deadline = time.monotonic() + grace_s + (channel.DRAIN_S if drain else 0.0)
    for child in stopping:
        if not child.ready:
            end([child.pid], 0.0, child=True)
        elif not (drain and closed_by(child.channel, deadline)):
            end([child.pid], deadline - time.monotonic(), child=True)
        child.channel.close()


def closed_by(sock: socket.socket, deadline: float) -> bool:
    """Whether the worker closes its end of ``sock`` by ``deadline`` (what it sends meanwhile is read and dropped)."""
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if not readable:
            break
        try:
            if channel.recv(sock) is None:
                return True
        except ProtocolError:
            return False
    return False


def describe_exit(status: int) -> str:
    """How a child ended, from its wait status: "killed by SIGKILL" / "exited with status 3"."""
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def create_semaphores(instance: str, generation: int, ranks: int, access: Access) -> list[posix_ipc.Semaphore]:
    """Each rank's semaphore of ``generation``, made exclusively with ``access``'s mode and group; on a failure those
    made are removed, then it raises."""
    made: list[posix_ipc.Semaphore] = []
    try:
        for rank in range(ranks):
            name = semaphore_name(instance, generation, rank)
            made.append(posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0))
            access.apply(SHM_DIR / f"sem.{name.lstrip('/')}")
    except BaseException:
        remove_semaphores(made)
        raise
    return made


def remove_semaphores(sems: Iterable[posix_ipc.Semaphore]) -> None:
    for sem in sems:
        with contextlib.suppress(posix_ipc.ExistentialError):
            sem.unlink()
        sem.close()


def progress_text(records: list[Record], per_rank_bytes: int) -> str:
    ready = sum(r.state is State.READY for r in records)
    done = sum(r.reserved_bytes for r in records)
    total = per_rank_bytes * len(records)
    gib = 2**30
    return f"allocating: {ready}/{len(records)} ranks ready, {done / gib:.2f} of {total / gib:.2f} GiB reserved"
