"""The runner's wait for its rank: bounded, blocking on a semaphore, never trusting a flag it cannot check.

A rank is ready for a runner when all of these hold at once (a flag left by a crashed run is never trusted):

* the instance's control block is published (magic written) and speaks this protocol version;
* the daemon in its header is alive: its pid runs and has the recorded start time (not a zombie);
* the rank's record says READY in the header's generation.

A rank whose daemon stopped keeping its memory for the next one (KEPT: ``kvcached stop --keep`` or ``kvcached restart``)
is waited through: the runner waits for the next daemon's control block, and attaches to the memory that daemon adopted.

While not ready the runner blocks on the rank's semaphore for at most ``SLICE_S``, then re-checks. The semaphore counts
posts, it is not a level: a waiter that wakes re-reads the record and posts once more when the state changed, so the
next waiter wakes too (a turnstile); a wake-up with no change consumes a leftover post and passes nothing on, so
leftovers drain instead of spinning. With no block (no daemon yet, or a dead one's stale block) it polls every
``POLL_ABSENT_S``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import posix_ipc

from kvcached.protocol.control import ControlBlock, Header, Record, State
from kvcached.protocol.declare import ACCEPTED, BUSY, declare
from kvcached.protocol.errors import AccessDenied, CacheLayoutMismatch, CacheNotReady, DaemonGone, RankFailed
from kvcached.protocol.instance import InstanceView, open_instance
from kvcached.protocol.layout import size_text
from kvcached.protocol.names import SHM_DIR, semaphore_name
from kvcached.protocol.spec import CacheSpec
from kvcached.protocol.trust import admitted, check_owner
from kvcached.protocol.waiters import mark_waiting

log = logging.getLogger("runner_client")

SLICE_S = 0.25
#: Seconds one declaration may take at most (less when the wait's deadline is nearer).
DECLARE_S = 5.0
POLL_ABSENT_S = 0.05
LOG_EVERY_S = 5.0


@dataclasses.dataclass(slots=True)
class Ready:
    """What a successful wait hands to the attach step: the mapped block, its header, the rank's record."""

    block: ControlBlock
    header: Header
    record: Record


def _wall(ns: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ns / 1e9))


class _Waiter:
    """State of one wait; ``run`` returns ``Ready`` or raises."""

    def __init__(self, instance: str, rank: int, timeout: float, declared: CacheSpec | None = None) -> None:
        self.instance = instance
        self.rank = rank
        self.timeout = timeout
        #: The spec this process declares (``--geometry engine``), and the generation that accepted it.
        self.declared = declared
        self.declared_to = 0
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.view: InstanceView | None = None
        self.block: ControlBlock | None = None
        self.header: Header | None = None
        self.sem: posix_ipc.Semaphore | None = None
        self.mark: int | None = None  # the waiting mark (see kvcached.protocol.waiters)
        self.stale_inode = -1
        # The live daemon this wait has seen (pid, start, generation): its death is DaemonGone, whereas a block stale
        # from the start only means "no daemon yet".
        self.followed: tuple[int, int, int] | None = None
        self.state = "no daemon"
        self.since_wall_ns = time.time_ns()
        self.last_log = self.started

    def _describe(self, state: str, since_wall_ns: int) -> None:
        if state != self.state:
            self.state, self.since_wall_ns = state, since_wall_ns

    def _drop_block(self) -> None:
        if self.mark is not None:
            os.close(self.mark)
            self.mark = None
        if self.sem is not None:
            self.sem.close()
            self.sem = None
        if self.view is not None:
            self.view.close()
            self.view = None
        self.block, self.header = None, None

    def _gone(self, why: str) -> DaemonGone:
        assert self.header is not None
        return DaemonGone(
            f"instance {self.instance!r} rank {self.rank}: daemon pid {self.header.daemon_pid} "
            f"(generation {self.header.generation:016x}) {why} while this runner waited for it; "
            f"last state {self.state} since {_wall(self.since_wall_ns)}"
        )

    def _maybe_log(self, now: float) -> None:
        if now - self.last_log >= LOG_EVERY_S:
            self.last_log = now
            log.info(
                "Waiting for cache managers to create kv cache.. instance=%s rank=%d state=%s "
                "waited=%.1fs timeout=%.1fs",
                self.instance,
                self.rank,
                self.state,
                now - self.started,
                self.timeout,
            )

    def _sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, min(seconds, self.deadline - time.monotonic())))

    def _find_block(self) -> bool:
        """Map a published block of a live daemon; False (after a short sleep) while there is none."""
        view = open_instance(self.instance)
        if view is None or view.block.inode == self.stale_inode or view.header is None:
            if view is not None:
                if view.block.inode != self.stale_inode:
                    self._describe("daemon starting", time.time_ns())
                view.close()
            else:
                self._describe("no daemon", time.time_ns())
            self._sleep(POLL_ABSENT_S)
            return False
        self._drop_block()  # only a mark is held here, on a stale block: the new one gets its own
        self.view, self.block, self.header = view, view.block, view.header
        header = view.header
        if header.num_ranks <= self.rank:
            self._drop_block()
            last = header.num_ranks - 1
            why = (
                f"out of range: the daemon serves ranks 0..{last} (--ranks {header.num_ranks}); "
                f"start it with --ranks {self.rank + 1} or more, or attach a rank of 0..{last}"
            )
            raise CacheLayoutMismatch(
                "num_ranks", header.num_ranks, self.rank + 1, instance=self.instance, rank=self.rank, why=why
            )
        if not view.alive:
            if self.followed == (header.daemon_pid, header.daemon_start, header.generation):
                raise self._gone("died")
            self._describe(f"stale (daemon pid {header.daemon_pid} is dead)", time.time_ns())
            self.stale_inode = view.block.inode
            self._drop_block()
            self.mark = mark_waiting(self.instance, self.rank)  # counted while we wait for a new daemon
            self._sleep(POLL_ABSENT_S)
            return False
        try:
            name = semaphore_name(self.instance, header.generation, self.rank)
            path = SHM_DIR / f"sem.{name.lstrip('/')}"
            check_owner(f"semaphore {name}", os.stat(path), owner=view.block.owner_uid)
            self.sem = posix_ipc.Semaphore(name)
        except posix_ipc.PermissionsError:
            raise AccessDenied(f"{name}: permission denied: {admitted(path)}") from None
        except (FileNotFoundError, posix_ipc.ExistentialError):
            self._drop_block()  # the daemon already unlinked its semaphores: it is stopping
            self._sleep(POLL_ABSENT_S)
            return False
        return True

    def _declare(self) -> None:
        """With a spec to declare: send it to a daemon waiting for the geometry (again each slice until one accepts
        it), or compare it with the daemon's; a difference raises ``CacheLayoutMismatch`` naming the field."""
        if self.declared is None or self.header is None or self.declared_to == self.header.generation:
            return
        assert self.block is not None
        header = self.header
        if header.awaits_geometry:
            seconds = min(DECLARE_S, max(0.01, self.deadline - time.monotonic()))  # never past the deadline
            answer = declare(
                header.run_dir, self.instance, self.rank, self.declared, owner_uid=self.block.owner_uid, timeout=seconds
            )
            if answer == ACCEPTED:
                self.declared_to = header.generation
                log.info("declared the geometry to instance=%s: %s", self.instance, self.declared)
            busy = " (the declaration socket is busy: asking again)" if answer == BUSY else ""
            self._describe(f"waiting for the engine to declare the geometry{busy}", time.time_ns())
            return
        differs = self.declared.first_difference(header.spec, CacheSpec.DECLARED_FIELDS)
        if differs is not None:
            field, theirs, ours = differs
            why = (
                f"the daemon holds another geometry: {field} is {theirs!r} in the daemon's (its configuration, or the "
                f"declaration it took first), {ours!r} in the spec this process (pid {os.getpid()}) declares"
            )
            raise CacheLayoutMismatch(field, theirs, ours, instance=self.instance, rank=self.rank, why=why)
        self.declared_to = header.generation

    def _read(self) -> Record | None:
        assert self.view is not None
        return self.view.record(self.rank, attempts=256)  # torn: the caller pauses and looks again

    def _judge(self, record: Record) -> bool:
        """True if ready; raises for FAILED / STOPPING; records the state for messages otherwise."""
        assert self.header is not None
        if record.generation != self.header.generation:
            self._describe("record of another generation", time.time_ns())
            return False
        if record.state is State.READY:
            return True
        if record.state is State.FAILED:
            raise RankFailed(
                f"instance {self.instance!r} rank {self.rank}: the daemon marked this rank FAILED at "
                f"{_wall(record.since_wall_ns)}: {record.error or 'no reason recorded'}"
            )
        if record.state is State.STOPPING:
            raise self._gone("is stopping")
        if record.state is State.KEPT:
            self._describe("KEPT (handed over to the next daemon)", record.since_wall_ns or time.time_ns())
            return False
        detail = record.state.name
        if record.state is State.ALLOCATING and record.total_bytes:
            detail += f" ({size_text(record.reserved_bytes)} of {size_text(record.total_bytes)} reserved)"
        self._describe(detail, record.since_wall_ns or time.time_ns())
        return False

    def _wait_for_successor(self) -> None:
        """The daemon handed the rank over (KEPT): its block is stale from now on; look for the next one."""
        assert self.block is not None
        self.stale_inode = self.block.inode
        self.followed = None  # the next daemon is a new one to follow
        self._drop_block()
        self.mark = mark_waiting(self.instance, self.rank)
        self._check_deadline()
        self._sleep(POLL_ABSENT_S)

    def _acquire(self) -> bool:
        assert self.sem is not None
        timeout = min(SLICE_S, self.deadline - time.monotonic())
        if timeout <= 0:
            return False
        try:
            self.sem.acquire(timeout)
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            return False
        return True

    def _check_deadline(self) -> None:
        if time.monotonic() >= self.deadline:
            raise CacheNotReady(
                f"instance {self.instance!r} rank {self.rank}: cache not ready after "
                f"{self.timeout:.1f}s; state {self.state} since {_wall(self.since_wall_ns)}",
                instance=self.instance,
                rank=self.rank,
                state=self.state,
            )

    def run(self) -> Ready:
        """Wait until ready and return the mapped block, or raise. The rank is looked at before the deadline is: a
        READY rank is attached even with ``timeout=0``."""
        pending: Record | None = None  # a record already read after a wake-up: not read again
        try:
            while True:
                self._maybe_log(time.monotonic())
                if self.block is None and not self._find_block():
                    self._check_deadline()
                    continue
                assert self.view is not None and self.block is not None and self.header is not None
                self._declare()
                record, pending = pending or self._read(), None
                if record is not None and record.state is State.FAILED:
                    self._judge(record)  # raises RankFailed: more precise than the daemon's exit after it
                if record is not None and record.state is State.KEPT and record.generation == self.header.generation:
                    self._judge(record)
                    self._wait_for_successor()
                    continue
                if not self.view.alive:
                    raise self._gone("died")
                if record is None:  # torn: its writer is mid-write, or died so; look again after a pause
                    self._describe("record being written", time.time_ns())
                    self._check_deadline()
                    self._sleep(POLL_ABSENT_S)
                    continue
                if self._judge(record):
                    ready = Ready(self.block, self.header, record)
                    self.view = None  # handed over: not closed by the finally below
                    return ready
                self._check_deadline()
                self.followed = (self.header.daemon_pid, self.header.daemon_start, self.header.generation)
                if self.mark is None:
                    self.mark = mark_waiting(self.instance, self.rank)
                if self._acquire():
                    pending = self._read()
                    if pending is None or pending.state != record.state:
                        assert self.sem is not None
                        self.sem.release()  # turnstile: pass the news to the next waiter
        finally:
            self._drop_block()


def wait_ready(instance: str, rank: int, timeout: float, *, declare: CacheSpec | None = None) -> Ready:
    """Block until ``rank`` of ``instance`` is READY in a live daemon's generation, at most ``timeout`` seconds. With
    ``declare``, declare that spec to a daemon waiting for the engine's geometry (and refuse a daemon that publishes
    another). Raises ``CacheNotReady``, ``DaemonGone``, ``RankFailed``, ``CacheLayoutMismatch`` or ``ProtocolError``.
    The returned block is mapped; the caller closes it."""
    log.info(
        "Waiting for cache managers to create kv cache.. instance=%s rank=%d timeout=%.1fs", instance, rank, timeout
    )
    return _Waiter(instance, rank, timeout, declare).run()


def wait_until_ready(instance: str, rank: int, timeout: float = 600.0, *, declare: CacheSpec | None = None) -> None:
    """Return once ``rank`` of ``instance`` is READY in a live daemon; raise ``CacheNotReady`` after ``timeout``
    seconds, ``DaemonGone`` / ``RankFailed`` at once when the daemon or the rank dies. The bounded, liveness-checked
    replacement for FastDeploy's ``while cache_ready_signal.value[local_rank] != 1: time.sleep(1)`` (see
    docs/fastdeploy.md): the runner then attaches its tensors the way it always has. ``declare``: see ``wait_ready``."""
    wait_ready(instance, rank, timeout, declare=declare).block.close()
