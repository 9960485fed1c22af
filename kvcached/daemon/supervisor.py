"""The supervisor: holds the instance lock, owns the control block's records, spawns and watches rank workers.

A start takes the steps ``kvcached.daemon.startup`` lists, in its order, then serves; how it ends (``_cleanup``) depends
on what it was asked (``kvcached.daemon.shutdown``). It is the only writer of the header and the records (each worker
writes its own stats slot), holding one ``RankSlot`` per rank (``kvcached.daemon.ranks``). Signal handlers only enqueue
(Python writes the signal number to a wake-up pipe); the main loop waits on a selector whose every key carries the
callback for its kind of event: the wake-up pipe (``_on_signals``; what each signal asks: ``kvcached.daemon.requests``),
a worker's channel (``_on_worker``), a channel of the last image's worker (``kvcached.daemon.handover``).

Faults cost a task, not the cache. A worker that dies, or stops making progress (``RankSlot.hung``: then it is killed),
is replaced: its rank goes RECOVERING, the new worker reopens the same memory (``DeviceBackend.reopen``, the CPU pool by
name; bytes untouched), then the rank is READY again. Runners' tasks in flight fail with ``TaskLost``; new tasks are
served. Only a rank that cannot be brought back (its worker fails to reopen, or dies ``MAX_REPLACEMENTS`` times within
``REPLACEMENT_WINDOW_S``) ends the daemon, with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import secrets
import selectors
import socket
import time
from collections.abc import Callable
from typing import Any

import posix_ipc
import structlog

from kvcached import logs, memory
from kvcached.access import Access
from kvcached.checks import counted
from kvcached.config import DaemonConfig
from kvcached.daemon import channel, declarations, faults, handover, shutdown, startup
from kvcached.daemon.adopt import Adoption, adopted_fields
from kvcached.daemon.exits import EXIT_FAILURE, EXIT_OK, EXIT_RESOURCES, Fatal
from kvcached.daemon.handover import Handover, Preflight
from kvcached.daemon.notify import Notifier
from kvcached.daemon.plan import WorkerPlan
from kvcached.daemon.ranks import (
    MAX_REPLACEMENTS,
    REPLACEMENT_WINDOW_S,
    Child,
    RankSlot,
    create_semaphores,
    describe_exit,
    fork_worker,
    progress_text,
    stop_children,
)
from kvcached.daemon.reclaim import unlink_entries
from kvcached.daemon.requests import RESTART_SIGNAL
from kvcached.daemon.wakeup import Requests
from kvcached.protocol.control import ControlBlock, Record, State
from kvcached.protocol.errors import ProtocolError
from kvcached.protocol.layout import cpu_pool_bytes
from kvcached.protocol.names import lock_path, shm_path, task_socket_path

#: The supervisor's loop turns at least this often.
TICK_S = 0.25

#: Called with the records after each allocation step (the CLI draws progress on a terminal with it).
ProgressHook = Callable[[list[Record]], None]
#: What a selector key carries: the callback for its kind of event; an exit status ends the loop.
Callback = Callable[[], int | None]


class Supervisor:
    """One daemon instance. ``run()`` returns the exit status; everything created is gone by then."""

    def __init__(
        self, config: DaemonConfig, on_progress: ProgressHook | None = None, preflight: Preflight | None = None
    ) -> None:
        self.config = config
        self.instance = config.instance
        self.backend = memory.get(config.memory)
        self.log = logs.get("kvcached.supervisor")
        self.generation = 0
        self.locks = startup.Locks(config.instance)
        self.block: ControlBlock | None = None
        self.slots: list[RankSlot] = []
        self.last_tick = time.monotonic()
        self.selector = selectors.DefaultSelector()
        self.run_dir = lock_path(config.instance).parent
        self.all_ready_logged = False
        self.notify = Notifier()
        self.on_progress = on_progress
        self.access = Access.for_daemon(config.gid)
        self.metrics = startup.MetricsEndpoint(config, self.log)  # --metrics-port
        self.arena_id = 0  # the generation that allocated the memory (ours, or the adopted one's)
        self.adoption: Adoption | None = None
        self.note = ""  # what the header tells `kvcached status` about the start
        self.preflight = preflight
        self.handover = Handover(self.selector, self.log, on_gone=self._give_turn)
        self.requests = Requests(
            self.log,
            refusals=handover.refusal_path(self.run_dir, self.instance),
            why_not_restart=lambda: self.handover.why_not_now(self.records, self.preflight),
            generation=lambda: self.generation,
        )

    @property
    def records(self) -> list[Record]:
        return [slot.record for slot in self.slots]

    def run(self) -> int:
        structlog.contextvars.bind_contextvars(instance=self.instance)
        self.requests.install()
        self._watch(self.requests, self._on_signals)
        status = EXIT_FAILURE
        try:
            status = self._loop() if self._start() else EXIT_OK
        except Fatal as fatal:
            self.log.error("fatal", reason=fatal.reason, exit_status=fatal.exit_status)
            self.notify.send(STATUS=f"failed: {fatal.reason}")
            status = fatal.exit_status
            raise
        finally:
            if self.requests.restart:
                self.notify.send(RELOADING=1, MONOTONIC_USEC=time.monotonic_ns() // 1000)
            else:
                self.notify.send(STOPPING=1)
            self._cleanup()
            self.notify.close()
            self.log.info("stopped", exit_status=status)
        return status

    def _watch(self, fileobj: Any, callback: Callback) -> None:
        self.selector.register(fileobj, selectors.EVENT_READ, callback)

    def _unwatch(self, fileobj: Any) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(fileobj)

    def _start(self) -> bool:
        """Everything before serving; False when told to stop first (while waiting for the geometry)."""
        self.config = declarations.held(self.config)  # --geometry engine: the geometry of memory left to adopt
        startup.refuse_runner_owned(self.config.spec)
        faults.check_env()
        self.locks.take(self.config.ranks, self.access)
        faults.fault("after-lock")
        self.adoption, self.note = startup.reclaim(
            self.config, self.run_dir, self.access, self.handover, self.log, grace_s=self.config.stop_timeout
        )
        faults.fault("after-reclaim")
        if self.config.geometry == "engine" and self.adoption is None:
            got = declarations.await_declaration(
                self.config, self.run_dir, self.access, wake_fd=self.requests.fileno(), notify=self.notify, log=self.log
            )
            if isinstance(got, int):
                self.requests.restart = got == RESTART_SIGNAL
                return False
            self.config = got
        startup.check_space(self.config, self.adoption)
        startup.check_store(self.config, self.log)
        self.generation = secrets.randbits(64) | 1
        self.arena_id = self.adoption.arena_id if self.adoption is not None else self.generation
        structlog.contextvars.bind_contextvars(generation=f"{self.generation:016x}")
        try:
            self._create_objects()
        except (OSError, posix_ipc.Error) as exc:  # /dev/shm filled up, or a name was taken meanwhile
            raise Fatal(f"cannot create the instance's objects in /dev/shm: {exc}", EXIT_RESOURCES) from None
        faults.fault("after-control-block")
        startup.log_start(self.config, self.note, self.log)
        for slot in self.slots:  # an adopted rank's worker reopens the memory the earlier record names
            if self.adoption is None:
                self._spawn(slot)
            else:
                self._spawn(slot, State.RECOVERING, reopen=self.adoption.records[slot.rank])
        assert self.block is not None
        self.metrics.open(self.block, restarted=self.handover.restarted)
        return True

    def _create_objects(self) -> None:
        """The per-rank semaphores, then the control block: written whole under its staging name (an adopted rank's
        record naming its memory), then given the public name, over the adopted run's block."""
        sems = create_semaphores(self.instance, self.generation, self.config.ranks, self.access)
        adopted = self.adoption is not None
        self.slots = [
            RankSlot(rank, Record(rank=rank, generation=self.generation), sem, whole=adopted)
            for rank, sem in enumerate(sems)
        ]
        faults.fault("after-semaphores")
        self.block = startup.stage_block(self.config, self.generation, self.arena_id, self.adoption, self.note)
        if self.adoption is not None:
            for slot, old in zip(self.slots, self.adoption.records, strict=True):
                self._set(slot, **adopted_fields(old, reopen_device=self.backend.outlives_worker))
        faults.fault("before-publish")
        self.block.install(replace=self.adoption is not None)

    def _spawn(self, slot: RankSlot, state: State = State.ALLOCATING, reopen: Record | None = None) -> None:
        """Fork ``slot``'s worker, to allocate the rank's memory or reopen what ``reopen`` names (``WorkerPlan.of``)."""
        assert self.block is not None
        stats = self.block.stats_slot(slot.rank)
        close: list[int | socket.socket] = [*self.locks.fds.values(), self.requests.read_fd, self.requests.write_fd]
        close += [s.worker.channel for s in self.slots if s.worker is not None]
        close += [old.channel for old in self.handover.predecessors.values()]
        worker = fork_worker(self._plan(slot.rank, reopen), stats, close=close)
        slot.hired(worker, stats.progress())
        self._watch(worker.channel, functools.partial(self._on_worker, slot))
        self._set(slot, state=state, worker_pid=worker.pid)

    def _replace(self, slot: RankSlot, why: str) -> None:
        """Fork a new worker for ``slot``, its worker dead or killed as hung: on the memory its record names (a rank
        that served, or an adopted one: RECOVERING, then READY), else allocating anew. Raises ``Fatal`` when the rank
        cannot be brought back."""
        died = slot.died(time.monotonic())
        if died > MAX_REPLACEMENTS:
            why = f"{why}; {died} workers of this rank died within {REPLACEMENT_WINDOW_S:.0f}s: giving up"
            raise self._rank_failed(slot, why, EXIT_FAILURE)
        if not self.handover.serves(slot.rank):  # else the last image's worker still listens there
            task_socket_path(self.run_dir, self.instance, slot.rank).unlink(missing_ok=True)
        if slot.names_memory():
            self.log.warning("replacing rank worker on the same memory", rank=slot.rank, reason=why)
            self._set(slot, error=why)
            self._spawn(slot, State.RECOVERING, reopen=slot.record)
            return
        # Nothing was published yet: remove what the dead worker half-made and allocate again.
        request = self._plan(slot.rank).tier_request()
        self.backend.release(request)
        unlink_entries([shm_path(request.shm_name(tier)) for tier in ("dev", "cpu", "keys")])
        self.log.warning("restarting rank worker's allocation", rank=slot.rank, reason=why)
        self._spawn(slot, State.ALLOCATING)

    def _plan(self, rank: int, reopen: Record | None = None) -> WorkerPlan:
        serving = self.handover.serves(rank)
        return WorkerPlan.of(
            self.config, rank, generation=self.generation, arena_id=self.arena_id, handover=serving, reopen=reopen
        )

    def _reap(self) -> None:
        """Replace every worker that has died (``waitpid`` once per worker, never blocking); reap strays."""
        self.handover.reap_strays()
        for slot in self.slots:
            worker = slot.worker
            if worker is not None and (status := worker.exit_status()) is not None:
                slot.worker = None
                self._unwatch(worker.channel)
                worker.channel.close()
                self._replace(slot, f"worker pid {worker.pid} {describe_exit(status)}")

    def _check_progress(self, tick: float) -> None:
        """Kill workers whose progress counter stood still for ``worker_timeout`` waking seconds (``RankSlot.hung``): a
        look counts at most twice the tick, so a pause of the supervisor (SIGSTOP, a debugger, a swapped-out host) is
        never blamed on its workers."""
        assert self.block is not None
        now = time.monotonic()
        awake, self.last_tick = min(now - self.last_tick, 2 * tick), now
        for slot in self.slots:
            if slot.worker is None:
                continue
            if slot.progressed(self.block.stats_slot(slot.rank).progress()):
                self._set(slot)  # its heartbeat
                continue
            why = slot.hung(awake, self.config.worker_timeout)
            if why:
                slot.kill(why, self.log)

    def _set(self, slot: RankSlot, **changes: Any) -> None:
        """Update ``slot``'s record (posting its semaphore when the state changed)."""
        assert self.block is not None
        slot.update(self.block, **changes)

    def _show_progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.records)

    def _rank_failed(self, slot: RankSlot, why: str, status: int) -> Fatal:
        self._set(slot, state=State.FAILED, error=why)
        return Fatal(f"rank {slot.rank} failed: {why}", status)

    def _loop(self) -> int:
        """The main loop: one callback per kind of event."""
        tick = min(TICK_S, self.notify.ping_interval() or TICK_S)
        while True:
            self.notify.ping_if_due()
            for key, _ in self.selector.select(timeout=tick):
                status = key.data()
                if status is not None:
                    return int(status)
            self.handover.kill_late()
            self.metrics.retry_if_due()
            self._reap()
            self._check_progress(tick)

    def _on_signals(self) -> int | None:
        """The wake-up pipe: EXIT_OK when a signal asks the daemon to end (``kvcached.daemon.wakeup``)."""
        return EXIT_OK if self.requests.read(self._log_ranks) else None

    def _log_ranks(self, signame: str) -> None:
        states = {r.rank: r.state.name for r in self.records}
        workers = sum(slot.worker is not None for slot in self.slots)
        self.log.info("ranks", signal=signame, states=states, workers=workers)

    def _on_worker(self, slot: RankSlot) -> None:
        """A message on ``slot``'s worker channel (or its EOF: the reaper replaces the worker)."""
        worker = slot.worker
        if worker is None:
            return
        try:
            message = channel.recv(worker.channel)
        except ProtocolError as exc:
            slot.kill(str(exc), self.log)
            return
        if message is None:  # the worker is gone (or going): the reaper replaces it
            self._unwatch(worker.channel)
            return
        slot.heard()
        match message:
            case channel.Allocating(total=total):
                self._set(slot, total_bytes=total)
            case channel.Progress(done=done):
                self._set(slot, reserved_bytes=done)
                per_rank = self.backend.arena_bytes(self.config.spec) + cpu_pool_bytes(self.config.spec)
                self.notify.status(progress_text(self.records, per_rank), throttle_s=0.5)
                self._show_progress()
            case channel.Ready():
                worker.ready = True
                self._on_ready(slot, message)
            case channel.Prepared():
                worker.prepared = True
                if self.handover.relieve(slot.rank, worker.pid, grace_s=self.config.stop_timeout):
                    self._give_turn(slot.rank)
            case channel.Failed(error=error, exit_status=exit_status):
                raise self._rank_failed(slot, error, exit_status)
            case _:
                slot.kill(f"unexpected message {message!r}", self.log)

    def _on_ready(self, slot: RankSlot, message: channel.Ready) -> None:
        """``slot``'s worker has the rank's tiers and listens: the rank is READY."""
        record = slot.record
        reopened = record.state is State.RECOVERING
        # Ready's fields are record fields of the same names (backend, descriptor, sizes, layout).
        self._set(slot, state=State.READY, reserved_bytes=record.total_bytes, error="", **dataclasses.asdict(message))
        slot.whole = True
        self._show_progress()
        if reopened and self.all_ready_logged:
            self.log.warning("rank recovered", rank=slot.rank, worker_pid=record.worker_pid)
            return
        self.log.info("rank adopted" if reopened else "rank ready", rank=slot.rank, bytes=record.total_bytes)
        if not self.all_ready_logged and all(r.state is State.READY for r in self.records):
            self.all_ready_logged = True
            self.log.info("all ranks ready", ranks=len(self.slots), note=self.note)
            total = sum(r.total_bytes for r in self.records)
            self.notify.send(READY=1, STATUS=f"serving {counted(len(self.slots), 'rank')}, {total / 2**30:.1f} GiB")
            faults.fault("after-ready")

    def _give_turn(self, rank: int) -> None:
        """The last image's worker of ``rank`` is done (or was none): the new one serves it if it said Prepared."""
        worker = self.slots[rank].worker
        if worker is None or not worker.prepared:
            return
        worker.prepared = False
        with contextlib.suppress(OSError):  # it died meanwhile: the reaper replaces it
            channel.send(worker.channel, channel.Serve())

    def handover_env(self) -> str | None:
        """What ``kvcached start`` sets ``handover.HANDOVER_ENV`` to before it executes itself again, or None."""
        if not self.requests.restart:
            return None
        self.requests.pass_on_pending()
        return self.handover.env(self.generation)

    def _cleanup(self) -> None:
        """Idempotent. Every record STOPPING, or KEPT when the memory is kept (``shutdown.keeps``); the workers stopped,
        or left serving for the next image; then the instance's objects released or kept, the lock last."""
        self.metrics.close()
        adopted = self.adoption is not None
        asked = self.requests
        keep = shutdown.keeps(
            self.slots, self.config.ranks, adopted=adopted, keep=asked.keep, stop=asked.stop, log=self.log
        )
        if self.block is not None:
            for slot in self.slots:
                if keep or slot.record.state is not State.FAILED:
                    self._set(slot, state=State.KEPT if keep else State.STOPPING)
        if keep and asked.restart and self.backend.outlives_worker:  # the workers serve on, for the next image
            self.handover.pass_on(self._let_go())
        else:  # every worker stopped, and every worker of the image before still serving
            workers = [*self._let_go().values(), *self.handover.drop_predecessors()]
            stop_children(workers, grace_s=self.config.stop_timeout, drain=keep)
        if not self.locks.held:
            return  # we never owned the instance: touch nothing
        self._keep_or_release(keep)
        if not self.handover.passing:  # else the workers still listen there
            for path in self.run_dir.glob(f"{self.instance}.r*.sock"):
                path.unlink(missing_ok=True)
        if not asked.restart:  # else the next image's restart signals are decided after this one's
            handover.refusal_path(self.run_dir, self.instance).unlink(missing_ok=True)
            self.locks.release()
        else:
            self.locks.pass_on()  # held across the exec: nobody takes the name in between

    def _keep_or_release(self, keep: bool) -> None:
        block, self.block = self.block, None
        if keep:
            shutdown.keep_for_next_start(
                block, self.slots, generation=self.generation, ranks=self.config.ranks, log=self.log
            )
            return
        tiers = [self._plan(rank).tier_request() for rank in range(self.config.ranks)]
        shutdown.release_everything(
            block,
            self.slots,
            config=self.config,
            backend=self.backend,
            tiers=tiers,
            generations=(self.generation, self.arena_id),
            log=self.log,
        )

    def _let_go(self) -> dict[int, Child]:
        """Every rank's worker, by rank, no longer the rank's nor watched here."""
        workers = {}
        for slot in self.slots:
            if slot.worker is not None:
                self._unwatch(slot.worker.channel)
                workers[slot.rank], slot.worker = slot.worker, None
        return workers
