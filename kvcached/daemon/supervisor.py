"""The supervisor: holds the instance lock, owns the control block's records, spawns and watches rank workers.

Start-up, in this order (each step is a fault-injection point, see ``kvcached.daemon.faults``):

1. refuse a spec for which the runner owns the cache (the fixed condition, cited in the message);
2. take ``<run_dir>/<instance>.lock`` (``kvcached.daemon.lockfile``), or exit 3 and touch nothing;
3. adopt the memory an earlier run of this instance left (killed, or stopped with ``--keep``) when
   ``kvcached.daemon.adopt`` finds it ours, of the same spec and consistent, giving it this start's mode
   and group; reclaim the rest of what it left (``kvcached.daemon.reclaim``; ours only: an object under
   our names owned by someone else is reported and never used or deleted, and at the control block's
   name it is refused);
4. check /dev/shm has room for every rank and tier it does not adopt, before anything is reserved;
5. create the per-rank semaphores, then the control block under a staging name, with its records (an
   adopted rank's name its memory), then give it the public name (over the adopted run's block: a kill
   at any step leaves a block that names the memory);
6. fork one worker per rank (``kvcached.daemon.worker``); each record goes ALLOCATING, then READY when its
   worker has reserved (adopted ranks: RECOVERING, then READY when its worker has reopened them).

The supervisor is the only writer of the header and the records (each worker writes its own stats slot).
Signal handlers only enqueue (Python writes the signal number to a wake-up pipe); the main loop
dispatches (the signals are listed in ``kvcached.daemon.requests``). On SIGTERM/SIGINT/SIGHUP every record
goes STOPPING (and its semaphore is posted), workers are stopped, and every object of the instance is
unlinked, the lock file last. On the keep signal every record goes KEPT instead, workers stop after the
requests clients already sent, and the memory and the control block stay for the next start to adopt.
The memory goes only when the operator says so: a daemon that ends for any other reason (a rank that
cannot be brought back, a crash) keeps it too, whenever every rank's memory is whole (published READY,
or adopted). SIGUSR1 logs each rank.

The restart signal (``kvcached restart``) keeps the memory too, but on a backend whose memory outlives its
workers (``host``) the workers go on serving: their channels are handed to the image ``kvcached start``
executes next (``kvcached.daemon.handover``), and each serves its rank until the next image's worker has
reopened the memory (Prepared). Only then is it told to drain, and when it has closed its channel the new
worker takes the task socket (Serve): the gap in service is a drain, not a start-up. A new image that
does not adopt the memory stops them first. A restart is refused, the daemon serving on, while a rank is
not READY or when the next image could not load its configuration.

Faults cost a task, not the cache. A worker is judged by progress, not by silence between tasks: its
``progress`` counter (``kvcached.protocol.stats``) must move within ``--worker-timeout`` seconds of the
supervisor's own waking time (a supervisor that was paused does not count the pause against anyone). A
worker that dies, or stops making progress (then it is killed), is replaced: its rank goes RECOVERING and
the new worker reopens the same memory (``DeviceBackend.reopen``, the CPU pool by name; bytes untouched),
then the rank is READY again. Runners' tasks in flight fail with ``TaskLost``; new tasks are served. Only
a rank that cannot be brought back (its worker fails to reopen, or dies ``MAX_REPLACEMENTS`` times within
``REPLACEMENT_WINDOW_S``) ends the daemon, with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import selectors
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import posix_ipc
import structlog

from kvcached import logs, memory, native, store
from kvcached.access import Access
from kvcached.config import DaemonConfig
from kvcached.daemon import channel, declare, faults, handover, lockfile, requests
from kvcached.daemon.adopt import Adoption, Refusal, adopted_fields, conform, judge, new_shm_need, start_note
from kvcached.daemon.errors import (
    EXIT_ALREADY_RUNNING,
    EXIT_CONFIG,
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_RESOURCES,
    Fatal,
)
from kvcached.daemon.handover import Preflight, Worker
from kvcached.daemon.notify import Notifier
from kvcached.daemon.reclaim import inspect_instance, remove_leftovers, unlink_entries
from kvcached.daemon.worker import DRAIN_S, WorkerPlan, worker_main
from kvcached.fastdeploy.flags import ReadyFlags as FastDeploySignals
from kvcached.memory.shm import shm_free_bytes
from kvcached.protocol.control import MAX_RUN_DIR, ControlBlock, Record, State
from kvcached.protocol.errors import ProtocolError, ResourceError, SignalError
from kvcached.protocol.layout import cpu_pool_bytes
from kvcached.protocol.names import (
    MAX_SOCKET_PATH,
    SHM_DIR,
    control_name,
    instance_lock_path,
    instance_shm_entries,
    lock_path,
    semaphore_name,
    task_socket_path,
)
from kvcached.protocol.ownership import cache_owner, explain_owner
from kvcached.protocol.proc import self_identity

#: How long stopping workers may take before they are killed.
STOP_GRACE_S = 5.0
#: The supervisor's loop turns at least this often.
TICK_S = 0.25
#: A rank whose workers die this many times within the window cannot be brought back.
MAX_REPLACEMENTS = 3
REPLACEMENT_WINDOW_S = 60.0

#: Called with the records after each allocation step (the CLI draws progress on a terminal with it).
ProgressHook = Callable[[list[Record]], None]


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class Supervisor:
    """One daemon instance. ``run()`` returns the exit status; everything created is gone by then."""

    def __init__(
        self, config: DaemonConfig, on_progress: ProgressHook | None = None, preflight: Preflight | None = None
    ) -> None:
        self.config = config
        self.spec = config.spec
        self.instance = config.instance
        self.backend = memory.get(config.memory)
        self.log = logs.get("kvcached.supervisor")
        self.generation = 0
        self.lock_fd: int | None = None
        self.block: ControlBlock | None = None
        self.sems: list[posix_ipc.Semaphore] = []
        self.records: list[Record] = []
        self.workers: dict[int, tuple[int, socket.socket]] = {}  # rank -> (pid, socket)
        self.progress: dict[int, tuple[int, float]] = {}  # rank -> (last progress seen, seconds it stood still)
        self.deaths: dict[int, list[float]] = {}  # rank -> when its workers died (within the window)
        self.instance_lock_fd: int | None = None
        self.last_tick = time.monotonic()
        self.selector = selectors.DefaultSelector()
        self.run_dir = lock_path(config.instance).parent
        self.wake_r, self.wake_w = -1, -1
        self.all_ready_logged = False
        self.notify = Notifier()
        self.on_progress = on_progress
        self.access = Access.for_daemon(config.gid)
        self.metrics: Any = None  # the metrics HTTP server, when --metrics-port is set
        self.signals: FastDeploySignals | None = None  # FastDeploy's flags, when --ipc-suffix is set
        self.arena_id = 0  # the generation that allocated the memory (ours, or the adopted one's)
        self.adoption: Adoption | None = None
        self.note = ""  # what the header tells `kvcached status` about the start
        self.keep = False  # stopping keeps the memory for the next start
        self.stop_requested = False  # the operator asked for a stop that releases the memory
        #: Ranks whose memory is whole (adopted, or READY once): kept unless the operator says otherwise.
        self.whole: set[int] = set()
        self.serving: set[int] = set()  # ranks whose worker said Ready: the others have no task to finish
        #: Set when the daemon stopped to execute itself again (``kvcached restart``): the caller does it.
        self.restart_requested = False
        self.preflight = preflight
        #: Children of an image of this process before ``kvcached restart`` executed it again: reaped here.
        self.strays = handover.children()
        #: What the image before this one says it handed over (checked once the instance lock is held).
        self.claim = handover.claim_from_env(self.log)
        if self.claim is not None:
            faults.restarted_image()
        self.restarted = False  # the claim checked out: this start was given by `kvcached restart`
        #: Workers of the image before this one, still serving their ranks (rank -> pid, channel), and the
        #: deadline of each told to drain.
        self.predecessors: dict[int, Worker] = {}
        self.relieving: dict[int, float] = {}
        self.awaiting_turn: set[int] = set()  # ranks whose worker said Prepared and waits for Serve
        #: Set by a restart's cleanup: the workers the next image takes over (``handover_env``).
        self.handing_over: dict[int, Worker] = {}

    # -- entry ----------------------------------------------------------------------------------------

    def run(self) -> int:
        """Start, serve until told to stop or a rank fails, clean up; return the exit status."""
        structlog.contextvars.bind_contextvars(instance=self.instance)
        self._install_signals()
        status = EXIT_FAILURE
        try:
            status = self._loop() if self._start() else EXIT_OK
        except Fatal as fatal:
            self.log.error("fatal", reason=fatal.reason, exit_status=fatal.exit_status)
            self.notify.send(STATUS=f"failed: {fatal.reason}")
            status = fatal.exit_status
            raise
        finally:
            if self.restart_requested:
                self.notify.send(RELOADING=1, MONOTONIC_USEC=time.monotonic_ns() // 1000)
            else:
                self.notify.send(STOPPING=1)
            self._cleanup()
            self.notify.close()
            self.log.info("stopped", exit_status=status)
        return status

    def _install_signals(self) -> None:
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        handled = (*requests.STOP_SIGNALS, requests.KEEP_SIGNAL, requests.RESTART_SIGNAL, requests.LOG_SIGNAL)
        for signum in (*handled, signal.SIGCHLD):
            signal.signal(signum, lambda *_: None)  # the wake-up fd carries the signal number
        self.selector.register(self.wake_r, selectors.EVENT_READ, None)
        handover.unblock_requests()  # held by the image before, if a restart executed this one

    # -- start-up -------------------------------------------------------------------------------------

    def _start(self) -> bool:
        """Everything before serving; False when told to stop first (while waiting for the geometry)."""
        self.config = declare.held(self.config)  # --geometry engine: the geometry of memory left to adopt
        spec = self.spec = self.config.spec
        if cache_owner(spec) == "runner":
            raise Fatal(
                f"refusing to allocate: {explain_owner(spec)}. A daemon-owned copy would be a second "
                "cache on the device. Enable CPU swap (--num-cpu-blocks > 0), a storage backend, or a "
                "prefill/decode role for the daemon to own it.",
                EXIT_CONFIG,
            )
        try:
            faults.check_env()
        except ValueError as exc:
            raise Fatal(str(exc), EXIT_CONFIG) from None
        self._lock()
        faults.fault("after-lock")
        self._reclaim()
        faults.fault("after-reclaim")
        if self.config.geometry == "engine" and self.adoption is None:
            got = declare.await_declaration(
                self.config, self.run_dir, self.access, wake_fd=self.wake_r, notify=self.notify, log=self.log
            )
            if isinstance(got, int):
                self.restart_requested = got == requests.RESTART_SIGNAL
                return False
            self.config, self.spec = got, got.spec
        self._check_space()
        self._check_store()
        self._open_fastdeploy_signals()
        self.generation = secrets.randbits(64) | 1
        self.arena_id = self.adoption.arena_id if self.adoption is not None else self.generation
        structlog.contextvars.bind_contextvars(generation=f"{self.generation:016x}")
        try:
            self._create_objects()
        except (OSError, posix_ipc.Error) as exc:  # /dev/shm filled up, or a name was taken meanwhile
            raise Fatal(f"cannot create the instance's objects in /dev/shm: {exc}", EXIT_RESOURCES) from None
        faults.fault("after-control-block")
        self.log.info(
            "starting",
            ranks=self.config.ranks,
            memory=self.config.memory,
            owner=explain_owner(self.spec),
            per_rank=mib(self.config.shm_need()[1]),
            glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""),
            copy_engine=native.describe(),
            **({"note": self.note} if self.note else {}),
        )
        for rank in range(self.config.ranks):
            if self.adoption is None:
                self._spawn(rank)
            else:
                self._adopt(rank, self.adoption.records[rank])
        if self.config.metrics_port:  # after the forks: its thread must not be copied into workers
            self._serve_metrics()
        return True

    def _check_store(self) -> None:
        chosen = self.config.store
        if chosen.backend is None:
            return
        try:
            warnings = store.get(chosen.backend).start_warnings(chosen.options, self.config.ranks)
        except OSError as exc:  # a path its options name cannot even be looked at (too long, ...)
            raise Fatal(f"attention store {chosen.backend}: {exc.strerror}: {exc.filename}", EXIT_CONFIG) from None
        for warning in warnings:
            self.log.warning("attention store", warning=warning)

    def _open_fastdeploy_signals(self) -> None:
        if self.config.ipc_suffix is None:
            return
        self.signals = FastDeploySignals(
            self.instance, self.config.ipc_suffix, self.config.ranks, self.access, self.config.engine_uid
        )
        try:
            self.signals.open()  # every rank 0 before anything can be READY
        except (SignalError, posix_ipc.Error, OSError) as exc:
            self.signals.close()
            self.signals = None
            raise Fatal(f"--ipc-suffix: {exc}", EXIT_RESOURCES) from None
        for warning in self.signals.take_warnings():
            self.log.warning("FastDeploy's ready flags", reason=warning)
        if self.signals.fileno() >= 0:
            self.selector.register(self.signals.fileno(), selectors.EVENT_READ, "fdsignals")

    def _create_objects(self) -> None:
        """The per-rank semaphores, then the control block: written whole under its staging name (an adopted
        rank's record naming its memory), then given the public name, over the adopted run's block."""
        for rank in range(self.config.ranks):
            name = semaphore_name(self.instance, self.generation, rank)
            self.sems.append(posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0))
            self.access.apply(SHM_DIR / f"sem.{name.lstrip('/')}")
        faults.fault("after-semaphores")
        pid, started = self_identity()
        self.block = ControlBlock.create(
            self.instance,
            generation=self.generation,
            spec=self.spec,
            num_ranks=self.config.ranks,
            daemon_pid=pid,
            daemon_start=started,
            run_dir=str(self.run_dir),
            mode=self.access.mode,
            gid=self.access.group,
            adopted_from=self.adoption.generation if self.adoption is not None else 0,
            arena_id=self.arena_id,
            note=self.note,
            staged=True,
        )
        self.records = [Record(rank=r, generation=self.generation) for r in range(self.config.ranks)]
        if self.adoption is not None:
            for rank, old in enumerate(self.adoption.records):
                self._set(rank, **adopted_fields(old, reopen_device=self.backend.outlives_worker))
        faults.fault("before-publish")
        self.block.install(replace=self.adoption is not None)

    def _adopt(self, rank: int, old: Record) -> None:
        """Fork rank ``rank``'s worker on the memory ``old`` (the earlier generation's record) describes: it
        reopens the device tier where its backend's memory outlived the old daemon (else makes it anew) and
        the CPU pool with its key directory, bytes untouched. Its record names that memory already: a
        worker that dies while reopening it is replaced on it (``_replace``), never made to allocate over it."""
        reopen_device = self.backend.outlives_worker
        plan = dataclasses.replace(
            self._plan(rank),
            device_descriptor=dict(old.descriptor) if reopen_device else None,
            reopen_pool=bool(old.cpu_bytes),
        )
        self._spawn(rank, plan, State.RECOVERING)

    def _serve_metrics(self) -> None:
        from kvcached.daemon import metrics

        assert self.block is not None
        address, port = self.config.metrics_address, self.config.metrics_port
        try:
            self.metrics = metrics.serve(self.instance, self.block, self.config.memory, address, port)
        except OSError as exc:
            raise Fatal(
                f"--metrics-port: cannot listen on {address}:{port}: {exc.strerror}; pick a free port or 0 for none",
                EXIT_CONFIG,
            ) from None
        self.log.info("metrics endpoint", url=f"http://{address}:{port}/metrics")

    def _lock(self) -> None:
        path = lock_path(self.instance)
        directory = path.parent
        longest = task_socket_path(directory, self.instance, self.config.ranks - 1)
        if len(str(directory).encode()) > MAX_RUN_DIR or len(str(longest).encode()) > MAX_SOCKET_PATH:
            raise Fatal(
                f"run directory {directory} is too long for Unix socket paths ({longest} needs at most "
                f"{MAX_SOCKET_PATH} bytes); set KVCACHED_RUN_DIR to a shorter directory",
                EXIT_CONFIG,
            )
        try:
            lockfile.prepare_run_dir(directory, self.access.gid)
            self.lock_fd = self._take(path)
            # One daemon per instance on the host, whatever run directory each was given: a second one's
            # reclaim must never see the first one's fresh objects as leftovers.
            self.instance_lock_fd = self._take(
                instance_lock_path(self.instance), mode=self.access.mode, gid=self.access.group
            )
        except ResourceError as exc:
            raise Fatal(str(exc), EXIT_RESOURCES) from None

    def _take(self, where: Path, *, mode: int = 0o600, gid: int | None = None) -> int:
        try:
            return lockfile.acquire(where, mode=mode, gid=gid)
        except lockfile.Locked as locked:
            who = f"pid {locked.holder.pid}" if locked.holder else "another process"
            raise Fatal(
                f"instance {self.instance!r} is already running ({who} holds {where}); "
                f"use another --instance name, or `kvcached stop --instance {self.instance}`",
                EXIT_ALREADY_RUNNING,
            ) from None

    def _reclaim(self) -> None:
        """Adopt what an earlier run of this instance left, if ``kvcached.daemon.adopt`` allows; remove the
        rest of it. A live instance, and an object someone else owns at the control block's name, are
        refused; objects someone else owns under other names are reported and left untouched."""
        found = inspect_instance(self.instance, self.run_dir)
        if found.live_pid is not None:
            raise Fatal(
                f"instance {self.instance!r} is live (daemon pid {found.live_pid}) under another run directory "
                f"than {self.run_dir}",
                EXIT_ALREADY_RUNNING,
            )
        control = SHM_DIR / control_name(self.instance).lstrip("/")
        for path, why in found.squatters:
            if path == control:
                raise Fatal(why, EXIT_RESOURCES)
            self.log.warning("left untouched: an object under this instance's names is not ours", reason=why)
        self._take_handover()
        fresh = self.config.fresh and not self.restarted
        if self.config.fresh and self.restarted:
            self.log.info("--fresh applies to the start it was given to, not to a restart: adopting the memory")
        verdict = None if fresh else judge(self.config)
        keep: set[Path] = set()
        if isinstance(verdict, Adoption):
            self.adoption = verdict
            self.whole = set(range(self.config.ranks))
            ours = f".{verdict.arena_id:016x}."
            keep = {entry for entry in found.entries if ours in entry.name and not entry.name.startswith("sem.")}
            keep |= {control} | {task_socket_path(self.run_dir, self.instance, rank) for rank in self.predecessors}
            self.log.info("adopting the memory of an earlier run", note=verdict.note)
        elif isinstance(verdict, Refusal):
            self.log.warning("not adopting the memory of an earlier run; reclaiming it", reason=verdict.reason)
        elif fresh and found.entries:
            verdict = Refusal(0, "--fresh")
        handed = bool(self.predecessors) and self.adoption is not None
        self.note = start_note(verdict, [path for path, _ in found.squatters], handed_over=handed)
        if self.predecessors and self.adoption is None:
            self.log.warning("stopping the last image's workers: their memory is not adopted")
            self._stop_workers()
        count = remove_leftovers(found, keep=keep)
        if count:
            self.log.info("reclaimed objects of an earlier run", count=count)
        if self.adoption is not None:
            try:
                conform(self.config, self.adoption, self.access)
            except OSError as exc:
                raise Fatal(
                    f"cannot give the adopted memory this start's mode and group: {exc}", EXIT_RESOURCES
                ) from None

    def _take_handover(self) -> None:
        """Take the workers the image before this one handed over, once its claim checks out: this image then
        is a restart's (``kvcached.daemon.handover``)."""
        if self.claim is not None:
            self.restarted, self.predecessors = handover.take(self.claim, self.instance, self.strays, self.log)
        for rank, (_, sock) in self.predecessors.items():
            self.selector.register(sock, selectors.EVENT_READ, ("predecessor", rank))

    def _check_space(self) -> None:
        need = new_shm_need(self.config, self.adoption)
        free = shm_free_bytes()
        if need > free:
            adopted = " besides the memory it adopts" if self.adoption is not None else ""
            raise Fatal(
                f"/dev/shm has {mib(free)} free, this configuration needs {mib(need)}{adopted} "
                f"({self.config.ranks} ranks x {mib(self.config.shm_need()[1])}); enlarge /dev/shm (docker "
                "--shm-size, mount -o remount,size=...) or lower --num-blocks / --num-cpu-blocks / --ranks",
                EXIT_RESOURCES,
            )

    def _spawn(self, rank: int, plan: WorkerPlan | None = None, state: State = State.ALLOCATING) -> None:
        """Fork rank ``rank``'s worker (a first one, or a replacement with ``plan``)."""
        assert self.block is not None
        plan = plan or self._plan(rank)
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # child: keep nothing of the supervisor's but the socket
            parent_sock.close()
            signal.set_wakeup_fd(-1)
            for fd in (self.lock_fd, self.instance_lock_fd, self.wake_r, self.wake_w):
                if fd is not None and fd >= 0:
                    os.close(fd)
            for _, other in (*self.workers.values(), *self.predecessors.values()):
                other.close()
            worker_main(child_sock, parent=parent, plan=plan, stats=self.block.stats_slot(rank))
        child_sock.close()
        self.workers[rank] = (pid, parent_sock)
        self.progress[rank] = (self.block.stats_slot(rank).progress(), 0.0)
        self.selector.register(parent_sock, selectors.EVENT_READ, rank)
        self._set(rank, state=state, worker_pid=pid)

    def _replace(self, rank: int, why: str) -> None:
        """Fork a new worker for ``rank`` after its worker died or was killed as hung. A rank that was
        serving keeps its memory: the new worker reopens it (RECOVERING, then READY). One that was still
        allocating starts over. Raises ``Fatal`` when the rank cannot be brought back."""
        now = time.monotonic()
        deaths = [t for t in self.deaths.get(rank, []) if now - t < REPLACEMENT_WINDOW_S] + [now]
        self.deaths[rank] = deaths
        if len(deaths) > MAX_REPLACEMENTS:
            raise self._rank_failed(
                rank,
                f"{why}; {len(deaths)} workers of this rank died within {REPLACEMENT_WINDOW_S:.0f}s: giving up",
                EXIT_FAILURE,
            )
        record = self.records[rank]
        plan = self._plan(rank)
        if rank not in self.predecessors:  # else the last image's worker still listens there
            task_socket_path(self.run_dir, self.instance, rank).unlink(missing_ok=True)
        if record.state in (State.READY, State.RECOVERING) and record.backend:
            plan = dataclasses.replace(
                plan,
                device_descriptor=dict(record.descriptor) if self.backend.outlives_worker else None,
                reopen_pool=bool(record.cpu_bytes),
            )
            self.log.warning("replacing rank worker on the same memory", rank=rank, reason=why)
            self._set(rank, error=why)
            self._spawn(rank, plan, State.RECOVERING)
            return
        # Nothing was published yet: remove what the dead worker half-made and allocate again.
        request = plan.tier_request()
        self.backend.release(request)
        unlink_entries([SHM_DIR / request.shm_name(tier).lstrip("/") for tier in ("dev", "cpu", "keys")])
        self.log.warning("restarting rank worker's allocation", rank=rank, reason=why)
        self._spawn(rank, plan, State.ALLOCATING)

    def _plan(self, rank: int) -> WorkerPlan:
        return WorkerPlan(
            instance=self.instance,
            generation=self.generation,
            rank=rank,
            ranks=self.config.ranks,
            spec=self.spec,
            run_dir=str(self.run_dir),
            store=self.config.store,
            access=self.access,
            memory=self.config.memory,
            device_id=self.config.devices[rank] if self.config.devices else rank,
            store_timeout=self.config.store_timeout,
            arena_id=self.arena_id,
            huge_pages=self.config.huge_pages,
            handover=rank in self.predecessors,
        )

    # -- records --------------------------------------------------------------------------------------

    def _set(self, rank: int, **changes: Any) -> None:
        """Update ``rank``'s record; post its semaphore when the state changed."""
        assert self.block is not None
        record = self.records[rank]
        new_state = changes.get("state", record.state)
        state_changed = new_state != record.state
        for key, value in changes.items():
            setattr(record, key, value)
        if state_changed:
            record.since_ns = time.monotonic_ns()
            record.since_wall_ns = time.time_ns()
        self.block.write(rank, record)
        if state_changed:
            self.sems[rank].release()
            if self.signals is not None:
                self.signals.update([self._has_cache(r) for r in self.records], has_pool=self.spec.num_cpu_blocks > 0)

    def _has_cache(self, record: Record) -> bool:
        """Whether rank ``record.rank`` has its device cache now (what FastDeploy's ready flag says): READY,
        or RECOVERING on device memory that outlived the worker it replaces (not yet, while this daemon
        reopens what it adopted: runners may attach only once it is READY)."""
        if record.state is State.READY:
            return True
        recovering = record.state is State.RECOVERING and self.all_ready_logged
        return recovering and self.backend.outlives_worker

    # -- main loop ------------------------------------------------------------------------------------

    def _loop(self) -> int:
        tick = min(TICK_S, self.notify.ping_interval() or TICK_S)
        while True:
            self.notify.ping_if_due()
            due = self.signals.due() if self.signals is not None else None
            for key, _ in self.selector.select(timeout=tick if due is None else min(tick, due)):
                if key.data is None:
                    status = self._on_signals()
                    if status is not None:
                        return status
                elif key.data == "fdsignals":
                    self._keep_fastdeploy_flags()
                elif isinstance(key.data, tuple):
                    self._on_predecessor(key.data[1])
                else:
                    self._on_worker(key.data)
            self._check_relieving()
            self._reap()
            self._check_progress(tick)
            self._keep_fastdeploy_flags()

    def _keep_fastdeploy_flags(self) -> None:
        if self.signals is None:
            return
        try:
            self.signals.tick()
        except (SignalError, posix_ipc.Error, OSError) as exc:
            self.log.warning("cannot keep FastDeploy's ready flags in step", reason=str(exc))
        for warning in self.signals.take_warnings():
            self.log.warning("FastDeploy's ready flags", reason=warning)

    def _on_signals(self) -> int | None:
        try:
            data = os.read(self.wake_r, 512)
        except BlockingIOError:
            return None
        for signum in data:
            if signum in requests.STOP_SIGNALS:
                self.stop_requested = True
                self.log.info("stopping", signal=requests.name(signum))
                return EXIT_OK
            if signum == requests.KEEP_SIGNAL:
                self.keep = True
                self.log.info("stopping, keeping the memory for the next start", signal=requests.name(signum))
                return EXIT_OK
            if signum == requests.RESTART_SIGNAL and self._accept_restart():
                return EXIT_OK
            if signum == requests.LOG_SIGNAL:
                states = {r.rank: r.state.name for r in self.records}
                self.log.info("ranks", signal=requests.name(signum), states=states, workers=len(self.workers))
        return None

    def _accept_restart(self) -> bool:
        """Whether to stop now for ``kvcached restart``; when not, say why where the CLI reads it, and serve on."""
        why = handover.why_no_restart(self.records, bool(self.predecessors), self.preflight)
        if why:
            self.log.error("restart refused; serving on", reason=why)
            handover.record_refusal(handover.refusal_path(self.run_dir, self.instance), why)
            return False
        handover.block_requests()  # a stop or restart sent from now on waits for the next image
        self.keep = self.restart_requested = True
        faults.fault("restart-accepted")
        self.log.info("restarting, keeping the memory for the next image", signal="SIGUSR2")
        return True

    def _on_worker(self, rank: int) -> None:
        _, sock = self.workers[rank]
        try:
            message = channel.recv(sock)
        except ProtocolError as exc:
            self._kill(rank, str(exc))
            return
        if message is None:  # the worker is gone (or going): the reaper replaces it
            self.selector.unregister(sock)
            return
        self.progress[rank] = (self.progress[rank][0], 0.0)  # a message is progress too
        record = self.records[rank]
        record.heartbeat_ns = time.monotonic_ns()
        match message:
            case channel.Allocating(total=total):
                self._set(rank, total_bytes=total)
            case channel.Progress(done=done):
                self._set(rank, reserved_bytes=done)
                self.notify.status(self._progress_text(), throttle_s=0.5)
                self._show_progress()
            case channel.Ready():
                reopened = record.state is State.RECOVERING
                # Ready's fields are record fields of the same names (backend, descriptor, sizes, layout).
                self._set(
                    rank, state=State.READY, reserved_bytes=record.total_bytes, error="", **dataclasses.asdict(message)
                )
                self.whole.add(rank)
                self.serving.add(rank)
                self._show_progress()
                if reopened and self.all_ready_logged:
                    self.log.warning("rank recovered", rank=rank, worker_pid=record.worker_pid)
                    return
                self.log.info("rank adopted" if reopened else "rank ready", rank=rank, bytes=record.total_bytes)
                if not self.all_ready_logged and all(r.state is State.READY for r in self.records):
                    self.all_ready_logged = True
                    self.log.info("all ranks ready", ranks=len(self.records), note=self.note)
                    total = sum(r.total_bytes for r in self.records)
                    self.notify.send(READY=1, STATUS=f"serving {len(self.records)} ranks, {total / 2**30:.1f} GiB")
                    faults.fault("after-ready")
            case channel.Prepared():
                self._relieve(rank)
            case channel.Failed(error=error, exit_status=exit_status):
                raise self._rank_failed(rank, error, exit_status)
            case _:
                self._kill(rank, f"unexpected message {message!r}")

    # -- a restart's handover -------------------------------------------------------------------------

    def _relieve(self, rank: int) -> None:
        """``rank``'s new worker has reopened the memory: tell the last image's worker to drain (it answers
        what clients still send NOT_RUN, then closes its channel); with none left, the rank is the new
        worker's at once."""
        self.awaiting_turn.add(rank)
        if rank not in self.predecessors:
            self._give_turn(rank)
            return
        if rank in self.relieving:
            return
        pid, sock = self.predecessors[rank]
        self.relieving[rank] = time.monotonic() + DRAIN_S + STOP_GRACE_S
        self.log.info("handing the rank over", rank=rank, from_pid=pid, to_pid=self.workers[rank][0])
        try:
            channel.send(sock, channel.Stop(drain=True))
        except OSError:
            self._predecessor_gone(rank)
        faults.fault("after-relieve")

    def _on_predecessor(self, rank: int) -> None:
        _, sock = self.predecessors[rank]
        try:
            message = channel.recv(sock)
        except (ProtocolError, OSError):
            message = None
        if message is None:  # done with every task (or dead): the rank is the new worker's
            self._predecessor_gone(rank)

    def _predecessor_gone(self, rank: int) -> None:
        pid, sock = self.predecessors.pop(rank)
        self.relieving.pop(rank, None)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(sock)
        sock.close()
        self.log.info("the last image's worker is done with the rank", rank=rank, worker_pid=pid)
        if rank in self.awaiting_turn:
            self._give_turn(rank)

    def _give_turn(self, rank: int) -> None:
        self.awaiting_turn.discard(rank)
        _, sock = self.workers[rank]
        with contextlib.suppress(OSError):  # it died meanwhile: the reaper replaces it
            channel.send(sock, channel.Serve())

    def _check_relieving(self) -> None:
        """Kill a worker of the last image that did not drain in time (its channel's EOF follows)."""
        now = time.monotonic()
        for rank, deadline in list(self.relieving.items()):
            if now >= deadline:
                pid, _ = self.predecessors[rank]
                self.log.error("killing the last image's worker: it did not drain", rank=rank, worker_pid=pid)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                self.relieving[rank] = float("inf")

    def handover_env(self) -> str | None:
        """What ``kvcached start`` puts in ``kvcached.daemon.handover.HANDOVER_ENV`` before executing itself
        again for ``kvcached restart``; None when it is not restarting."""
        if not self.restart_requested:
            return None
        return handover.env_for(self.generation, self.handing_over)

    def _progress_text(self) -> str:
        return progress_text(self.records, self.backend.arena_bytes(self.spec) + cpu_pool_bytes(self.spec))

    def _show_progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.records)

    def _rank_failed(self, rank: int, why: str, status: int) -> Fatal:
        self._set(rank, state=State.FAILED, error=why)
        return Fatal(f"rank {rank} failed: {why}", status)

    def _reap(self) -> None:
        """Replace every worker that has died (``waitpid`` once per worker, never blocking); reap strays."""
        for pid in list(self.strays):
            with contextlib.suppress(ChildProcessError):
                if not os.waitpid(pid, os.WNOHANG)[0]:
                    continue
            self.strays.remove(pid)
        for rank, (pid, _) in list(self.workers.items()):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                self._forget(rank)
                self._replace(rank, f"worker pid {pid} {describe_exit(status)}")

    def _forget(self, rank: int) -> None:
        self.awaiting_turn.discard(rank)
        self.serving.discard(rank)
        _, sock = self.workers.pop(rank)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(sock)
        sock.close()

    def _kill(self, rank: int, why: str) -> None:
        """SIGKILL a worker; the reaper replaces it."""
        pid, _ = self.workers[rank]
        self.log.error("killing rank worker", rank=rank, worker_pid=pid, reason=why)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def _check_progress(self, tick: float) -> None:
        """Kill workers whose progress counter stood still for ``worker_timeout`` seconds of our waking time.

        The time counted between two looks is capped at twice the tick, so a supervisor that was paused
        (SIGSTOP, a debugger, a swapped-out host) never blames its workers for the pause."""
        assert self.block is not None
        now = time.monotonic()
        awake, self.last_tick = min(now - self.last_tick, 2 * tick), now
        for rank in list(self.workers):
            seen = self.block.stats_slot(rank).progress()
            last, still = self.progress[rank]
            if seen != last:
                self.progress[rank] = (seen, 0.0)
                self.records[rank].heartbeat_ns = time.monotonic_ns()
                self._set(rank)
                continue
            still += awake
            self.progress[rank] = (last, still)
            if still > self.config.worker_timeout and self.records[rank].state in (State.READY, State.RECOVERING):
                self._kill(rank, f"no progress for {still:.1f}s (hung)")
                self.progress[rank] = (last, float("-inf"))  # killed once; the reaper takes it from here

    # -- stop -----------------------------------------------------------------------------------------

    def _cleanup(self) -> None:
        """Idempotent: STOPPING, stop workers, unlink every object of this instance, release the lock. When the
        memory is kept (``_keeps``), KEPT instead, and the memory and the control block stay."""
        if self.metrics is not None:
            self.metrics.shutdown()
            self.metrics.server_close()
            self.metrics = None
        keep = self._keeps()
        if self.block is not None:
            for rank, record in enumerate(self.records):
                if keep or record.state is not State.FAILED:
                    self._set(rank, state=State.KEPT if keep else State.STOPPING)
        if keep and self.restart_requested and self.backend.outlives_worker:
            self._hand_over()
        else:
            self._stop_workers(drain=keep)
        if self.signals is not None:
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.signals.fileno())
            self.signals.close()
            self.signals = None
        if self.lock_fd is None:
            return  # we never owned the instance: touch nothing
        if self.block is not None:
            if not keep or not self.block.installed:  # a staged block never named the kept memory
                self.block.unlink()
            self.block.close()
            self.block = None
        for sem in self.sems:
            with contextlib.suppress(posix_ipc.ExistentialError):
                sem.unlink()
            sem.close()
        self.sems = []
        if self.generation and not keep:
            for rank in range(self.config.ranks):
                self.backend.release(self._plan(rank).tier_request())
            self._release_store()
            # Every object of this instance's generation and of the memory's (arenas, pools, key
            # directories, a semaphore or arena a killed worker half-made). Objects we refused at start-up
            # carry neither name: they are not ours.
            names = {f".{self.generation:016x}.", f".{self.arena_id:016x}."}
            unlink_entries([e for e in instance_shm_entries(self.instance) if any(n in e.name for n in names)])
        elif keep:
            self.log.info("kept for the next start", generation=f"{self.generation:016x}", ranks=self.config.ranks)
        for path in self.run_dir.glob(f"{self.instance}.r*.sock"):
            if not self.handing_over:  # else the workers still listen there
                path.unlink(missing_ok=True)
        handover.refusal_path(self.run_dir, self.instance).unlink(missing_ok=True)
        if self.instance_lock_fd is not None:
            lockfile.release(instance_lock_path(self.instance), self.instance_lock_fd)
            self.instance_lock_fd = None
        lockfile.release(lock_path(self.instance), self.lock_fd)
        self.lock_fd = None

    def _keeps(self) -> bool:
        """Whether stopping keeps the memory: when every rank's memory is whole, unless the operator asked for
        a stop that releases it (a stop with --keep, a restart, a rank that cannot be brought back, a
        crash: all keep it). Memory not yet whole is nothing to keep: released, and said so."""
        if len(self.whole) < self.config.ranks:
            if self.keep:
                states = {r.rank: r.state.name for r in self.records if r.rank not in self.whole}
                self.log.warning("not keeping the memory: some ranks were never whole", states=states)
            return False
        if not self.keep and not self.stop_requested:
            self.log.warning("keeping the memory for the next start: the daemon ends without being told to stop")
        return self.keep or not self.stop_requested

    def _release_store(self) -> None:
        """A final stop: the store backend lets go of what it keeps across daemon runs (Mooncake keepers)."""
        chosen = self.config.store
        if chosen.backend is not None:
            try:
                store.get(chosen.backend).release(chosen.options, instance=self.instance)
            except Exception as exc:  # a stop goes on: the keepers quit by themselves once the instance is gone
                self.log.warning("attention store: could not let go of what it keeps", reason=str(exc))

    def _hand_over(self) -> None:
        """Leave every worker serving, its channel open across the exec for the next image to take."""
        for rank, (pid, sock) in list(self.workers.items()):
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(sock)
            sock.set_inheritable(True)
            self.handing_over[rank] = (pid, sock)
        self.workers.clear()
        self.log.info("handing the workers to the next image", workers=len(self.handing_over))

    def _stop_workers(self, *, drain: bool = False) -> None:
        """Stop every worker (and every worker of the image before, still serving) and wait for it to exit;
        with ``drain`` (a handover), wait only until it has closed its channel: it is done with every task,
        and its exit (unmapping gigabytes) need not hold up the next daemon. An image executed after this
        one reaps it (``strays``). A worker that never said Ready (allocating, reopening) is killed at once:
        it has no task to finish, and stopping it changes no byte of memory a start could adopt."""
        unready = {pid for rank, (pid, _) in self.workers.items() if rank not in self.serving}
        stopping = [*self.workers.values(), *self.predecessors.values()]
        for _, sock in stopping:
            with contextlib.suppress(OSError):
                channel.send(sock, channel.Stop(drain=drain))
        deadline = time.monotonic() + STOP_GRACE_S + (DRAIN_S if drain else 0.0)
        for pid, sock in stopping:
            if pid in unready:
                handover.wait_or_kill(pid, 0.0)
            elif not (drain and handover.closed_by(sock, deadline)):
                handover.wait_or_kill(pid, deadline)
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(sock)
            sock.close()
        self.workers.clear()
        self.predecessors.clear()
        self.relieving.clear()
        self.awaiting_turn.clear()


def describe_exit(status: int) -> str:
    """How a child ended, from its wait status: "killed by SIGKILL" / "exited with status 3"."""
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def progress_text(records: list[Record], per_rank_bytes: int) -> str:
    """One line of allocation progress: ranks ready and bytes reserved of all."""
    ready = sum(r.state is State.READY for r in records)
    done = sum(r.reserved_bytes for r in records)
    total = per_rank_bytes * len(records)
    gib = 2**30
    return f"allocating: {ready}/{len(records)} ranks ready, {done / gib:.2f} of {total / gib:.2f} GiB reserved"
