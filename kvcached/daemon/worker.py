"""A rank worker: a child of the supervisor that allocates and holds one rank's tiers and serves its tasks.

Its life, in three steps, each raising ``WorkerFailure`` (a reason and the daemon's exit status) when it cannot go on:

1. ``allocate``: the device tier (through its backend, ``kvcached.memory``) and the CPU pool, reporting progress; or,
   for a worker replacing one that died or of a daemon that adopted an earlier run's memory, ``reopen`` them with their
   bytes untouched. After ``kvcached restart`` the last image's worker serves the rank meanwhile: this one says Prepared
   and waits for Serve (``await_turn``) before the CPU pool's key directory (``kvcached.daemon.keydir``);
2. ``open_store``: this rank's client of the attention store, if any (``kvcached.store``), run in a store agent process
   forked by the worker, with a deadline per call (``kvcached.daemon.store_agent``);
3. ``serve``: listen on the rank's task socket (``kvcached.daemon.frames``) and run tasks (``kvcached.daemon.server``)
   until told to stop; for a handover (``Stop(drain=True)``) it first answers arriving tasks NOT_RUN until its clients
   are quiet.

Liveness: the worker adds to the ``progress`` counter of its stats slot each time its loop turns (at least once a
second) and at every step of a long task (``RankSlot.hung`` judges it). It talks to the supervisor through
``kvcached.daemon.channel``, never writes a rank record (only its stats slot) and never unlinks: the supervisor knows
every name and removes them all, also after a worker was killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import resource
import selectors
import signal
import socket
import time
from collections.abc import Callable
from typing import NoReturn

import posix_ipc
import structlog

from kvcached import logs, memory, store
from kvcached.access import PRIVATE_MODE
from kvcached.copy_engine import DeviceBlocks, SwapEngine
from kvcached.daemon import channel, faults, server
from kvcached.daemon.channel import DRAIN_S
from kvcached.daemon.exits import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, EXIT_RESOURCES, WorkerFailure
from kvcached.daemon.frames import FrameServer
from kvcached.daemon.keydir import KeyDirectory
from kvcached.daemon.plan import WorkerPlan
from kvcached.daemon.store_agent import StoreCalls
from kvcached.memory.base import DeviceTier, Piece, TierRequest
from kvcached.memory.shm import create_arena, huge_pages, open_arena, pin, prefault
from kvcached.protocol.errors import (
    BackendUnavailable,
    NotTrusted,
    ProtocolError,
    ResourceError,
    ShmFull,
    StoreBusy,
    StoreUnavailable,
)
from kvcached.protocol.layout import LAYOUT_VERSION, cpu_pool_bytes
from kvcached.protocol.names import task_socket_path
from kvcached.protocol.proc import die_with_parent
from kvcached.protocol.stats import StatsSlot
from kvcached.store.base import ObjectIdentity, Store

#: The worker's loop turns (and marks progress) at least this often.
LOOP_S = 0.5
#: Handing over: done when no client sent anything for this long (or after ``channel.DRAIN_S``).
DRAIN_QUIET_S = 0.02


@dataclasses.dataclass(slots=True)
class RankTiers:
    """A rank's memory as its worker holds it."""

    device: DeviceTier
    pool: mmap.mmap | None
    pool_name: str
    keys: KeyDirectory | None = None
    warm: bool = False  # every page is mapped already (``warm``)

    def map_pages(self, *, until_done: Callable[[], None] | None = None) -> None:
        """Map every page of the device tier and the pool in the background; with ``until_done``, wait until they are
        mapped, calling it every ``LOOP_S`` meanwhile (the worker's progress mark: gigabytes take seconds)."""
        if self.warm:
            return
        self.warm = True
        threads = [self.device.warm(), prefault(self.pool) if self.pool is not None else None]
        if until_done is None:
            return
        for thread in filter(None, threads):
            while thread.is_alive():
                thread.join(LOOP_S)
                until_done()


def worker_main(sock: socket.socket, *, parent: int, plan: WorkerPlan, stats: StatsSlot) -> NoReturn:
    """Entry point in the forked child. Never returns: exits with a status for the supervisor's log.
    ``stats`` is the rank's slot in the control block, the only part of it the worker writes."""
    if not die_with_parent(parent):  # the kernel SIGKILLs us when the supervisor dies (it died already: exit)
        os._exit(EXIT_FAILURE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the supervisor's to handle
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_DFL)
    os.umask(0o077)
    structlog.contextvars.bind_contextvars(rank=plan.rank)
    log = logs.get("kvcached.worker")
    status = EXIT_FAILURE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:  # the soft open-file limit up to the hard one: the usual 1024 is low for a busy rank
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if plan.store.backend is not None and not plan.handover:
        stats.set(store_unavailable=1)  # until its store is open (a handover's predecessor serves it meanwhile)
    try:
        tiers = allocate(sock, plan, log)
        if plan.handover:  # the last image's worker serves meanwhile: its time costs nothing
            tiers.map_pages(until_done=stats.progressed)
        if not plan.handover or await_turn(sock, stats):
            tiers.keys = _key_directory(plan, plan.tier_request(), log) if tiers.pool is not None else None
            rank_store = open_store(plan, stats, log, tiers.device.pieces)
            status = serve(sock, plan, tiers, rank_store, stats=stats, log=log)
        else:
            status = EXIT_OK  # stopped before its turn came
    except WorkerFailure as failure:
        log.error("rank worker cannot go on", reason=failure.reason)
        status = failure.exit_status
        with contextlib.suppress(OSError):
            channel.send(sock, channel.Failed(failure.reason, failure.exit_status))
    except BaseException as exc:  # the process ends here either way; say why first
        log.exception("rank worker crashed")
        with contextlib.suppress(OSError):
            channel.send(sock, channel.Failed(f"worker crashed: {exc!r}", EXIT_FAILURE))
    finally:
        with contextlib.suppress(OSError):
            sock.close()  # the supervisor sees it at once; the exit itself (unmapping) takes longer
        with contextlib.suppress(OSError):
            os.nice(19)  # and must not slow the next worker's first tasks
        os._exit(status)


def _reporter(sock: socket.socket, total: int) -> Callable[[int], memory.base.Progress]:
    """``progress(base)``: a callback that reports ``base`` plus the bytes it is given to the supervisor, at
    most every 100 ms (and always the last byte)."""
    last_sent = 0.0

    def progress(base: int) -> memory.base.Progress:
        def report(done: int) -> None:
            nonlocal last_sent
            now = time.monotonic()
            if now - last_sent >= 0.1 or base + done == total:
                last_sent = now
                channel.send(sock, channel.Progress(base + done))

        return report

    return progress


def allocate(sock: socket.socket, plan: WorkerPlan, log: logs.Logger) -> RankTiers:
    backend = memory.get(plan.memory)
    request = plan.tier_request()
    dev_bytes, cpu_bytes = backend.arena_bytes(plan.spec), cpu_pool_bytes(plan.spec)
    total = dev_bytes + cpu_bytes
    channel.send(sock, channel.Allocating(total))
    faults.fault("worker-allocating")
    progress = _reporter(sock, total)
    pool_name = request.shm_name("cpu")
    try:
        if plan.device_descriptor is not None:
            device = backend.reopen(request, plan.device_descriptor)
            progress(0)(dev_bytes)
        else:
            device = backend.create(request, progress(0))
        if not cpu_bytes:
            pool = None
        elif plan.reopen_pool:
            pool = open_arena(pool_name, cpu_bytes, populate=False)
            progress(dev_bytes)(cpu_bytes)
        else:
            pool = create_arena(
                pool_name, cpu_bytes, progress(dev_bytes), mode=PRIVATE_MODE, gid=request.gid, huge=plan.huge_pages
            )
    except BackendUnavailable as exc:
        raise WorkerFailure(str(exc), EXIT_CONFIG) from None
    except ShmFull as exc:
        raise WorkerFailure(str(exc.strerror), EXIT_RESOURCES) from None
    except ResourceError as exc:
        raise WorkerFailure(str(exc), EXIT_RESOURCES) from None
    except posix_ipc.ExistentialError:
        what = "is gone" if plan.reopen_pool else "is taken by another process"
        raise WorkerFailure(f"CPU pool {pool_name} {what}", EXIT_RESOURCES) from None
    except ProtocolError as exc:
        raise WorkerFailure(f"CPU pool {pool_name}: {exc}", EXIT_RESOURCES) from None
    if backend.pins_pool and pool is not None:
        try:
            pin(pool)  # the device copies to and from it by DMA, as FastDeploy's mlocked swap space
        except OSError as exc:
            raise WorkerFailure(f"CPU pool of rank {plan.rank}: {exc.strerror}", EXIT_RESOURCES) from None
    log.info(
        "tiers reserved",
        device_bytes=device.nbytes,
        cpu_bytes=cpu_bytes,
        backend=plan.memory,
        huge_pages=huge_pages() if plan.huge_pages else "not asked for",
    )
    return RankTiers(device, pool, pool_name if pool is not None else "")


def await_turn(sock: socket.socket, stats: StatsSlot) -> bool:
    """Say Prepared, then wait for Serve (True) or Stop (False), marking progress meanwhile."""
    channel.send(sock, channel.Prepared())
    faults.fault("worker-prepared")
    sock.settimeout(LOOP_S)
    try:
        while True:
            stats.progressed()
            try:
                message = channel.recv(sock)
            except TimeoutError:
                continue
            if isinstance(message, channel.Serve):
                return True
            if message is None or isinstance(message, channel.Stop):
                return False
    finally:
        sock.settimeout(None)


def _key_directory(plan: WorkerPlan, request: TierRequest, log: logs.Logger) -> KeyDirectory | None:
    """The CPU pool's key directory: the one a reopened pool has (an empty new one when it has none or
    it cannot be read: an empty directory is always true), else a new one; None when another user's
    object holds its name (the pool then serves by block id only)."""
    name, slots = request.shm_name("keys"), plan.spec.num_cpu_blocks
    try:
        if plan.reopen_pool:
            try:
                keys = KeyDirectory.open(name, slots)
                log.info("key directory reopened", keyed_blocks=len(keys))
                return keys
            except posix_ipc.ExistentialError:
                pass
            except NotTrusted as exc:  # someone else's object at its name: never used, never removed
                log.error("serving without a key directory", reason=str(exc))
                return None
            except ProtocolError as exc:
                log.warning("key directory unreadable: starting an empty one", reason=str(exc))
                posix_ipc.unlink_shared_memory(name)
        return KeyDirectory.create(name, slots, mode=PRIVATE_MODE, gid=request.gid)
    except ShmFull as exc:
        raise WorkerFailure(str(exc.strerror), EXIT_RESOURCES) from None
    except posix_ipc.Error as exc:
        raise WorkerFailure(f"key directory {name}: {exc}", EXIT_RESOURCES) from None


#: How long a worker waits for its store to open before serving without it (store tasks fail until it answers).
STORE_OPEN_WAIT_S = 5.0
#: Bytes of block records moved per store call (a staging buffer shared with the store agent).
STAGING_BYTES = 64 << 20


def open_store(plan: WorkerPlan, stats: StatsSlot, log: logs.Logger, pieces: list[Piece]) -> StoreCalls | None:
    """This rank's attention store behind its agent process, or None without a store. A store that refuses to open (its
    directory held by another daemon, unwritable) fails the worker; one that does not answer yet leaves the rank to
    serve its other tiers. A ``direct`` backend on a host device tier (``pieces``) gets the device blocks themselves."""
    if plan.store.backend is None:
        return None
    identity = ObjectIdentity(plan.spec.geometry_digest, plan.rank, plan.spec.block_bytes)
    backend = store.get(plan.store.backend)

    def opener() -> Store:
        return backend.open(plan.store.options, identity=identity, rank=plan.rank, ranks=plan.ranks, log=log)

    calls = StoreCalls(
        backend.name,
        opener,
        record_bytes=plan.spec.block_bytes,
        staging_bytes=STAGING_BYTES,
        timeout_s=plan.store_timeout,
        progress=stats.progressed,
        log=log,
        device=DeviceBlocks.of(pieces) if backend.direct else None,
    )
    try:
        calls.wait_open(min(plan.store_timeout, STORE_OPEN_WAIT_S))
    except StoreBusy as exc:  # its directory is another daemon's: a resource taken, as `start --help` says
        calls.close()
        raise WorkerFailure(f"attention store: {exc}", EXIT_RESOURCES) from None
    except (StoreUnavailable, OSError, RuntimeError) as exc:
        calls.close()
        raise WorkerFailure(f"attention store: {exc}", EXIT_CONFIG) from None
    return calls


def serve(
    sock: socket.socket,
    plan: WorkerPlan,
    tiers: RankTiers,
    rank_store: StoreCalls | None,
    *,
    stats: StatsSlot,
    log: logs.Logger,
) -> int:
    """Listen on the rank's task socket, report READY, and run tasks until the supervisor says stop."""
    slow = faults.hook("copy-step")

    def step() -> None:
        stats.progressed()
        if slow is not None:
            slow()

    engine = SwapEngine(
        plan.spec,
        tiers.device.pieces,
        tiers.pool,
        on_step=step,
        pool_layout=memory.get(plan.memory).pool_layout,
        tier_swap=tiers.device.pool_swap(tiers.pool) if tiers.pool is not None else None,
    )
    tasks = server.TaskServer(
        engine=engine,
        stats=stats,
        rank=plan.rank,
        generation=plan.generation,
        log=log,
        store=rank_store,
        keys=tiers.keys,
    )
    selector = selectors.DefaultSelector()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    socket_path = task_socket_path(plan.run_dir, plan.instance, plan.rank)
    socket_path.unlink(missing_ok=True)  # a dead predecessor's (the supervisor made sure it is ours)
    listener.bind(str(socket_path))
    plan.access.apply_socket(socket_path)
    listener.listen(1024)
    listener.setblocking(False)
    frames = FrameServer(
        listener=listener,
        selector=selector,
        execute=tasks.execute,
        stats=stats,
        log=log,
        who=f"the worker of rank {plan.rank}",
        access=plan.access,
    )
    faults.fault("worker-before-ready")
    ready = channel.Ready(
        backend=plan.memory,
        descriptor=dict(tiers.device.descriptor),
        dev_bytes=tiers.device.nbytes,
        cpu_name=tiers.pool_name,
        cpu_bytes=len(tiers.pool) if tiers.pool is not None else 0,
        layout_version=LAYOUT_VERSION,
    )
    channel.send(sock, ready)
    tiers.map_pages()  # the pages of memory reserved (or reopened) above are mapped from now on
    try:
        return Service(sock, selector=selector, frames=frames, tasks=tasks, stats=stats, log=log).run()
    finally:
        if rank_store is not None:
            rank_store.close()


@dataclasses.dataclass(slots=True)
class Service:
    """A serving worker's loop: its selector's every key carries the callback for its events (the frame
    server's listener and connections, the supervisor's channel), and chores run once a second."""

    sock: socket.socket
    selector: selectors.BaseSelector
    frames: FrameServer
    tasks: server.TaskServer
    stats: StatsSlot
    log: logs.Logger
    draining_until: float = 0.0  # set by Stop(drain=True): answer what clients send NOT_RUN until they are quiet
    status: int | None = None  # set when told to stop

    def __post_init__(self) -> None:
        self.selector.register(self.sock, selectors.EVENT_READ, self._on_supervisor)
        self.frames.listen()

    def run(self) -> int:
        next_chores = 0.0
        while True:
            self.stats.progressed()
            idle = DRAIN_QUIET_S if self.draining_until else LOOP_S
            events = self.selector.select(timeout=0 if self.frames.backlog else idle)
            for key, mask in events:
                key.data(mask)
                if self.status is not None:
                    return self.status
            self.frames.run_backlog()  # one turn, of the connection with whole requests that has moved least
            now = time.monotonic()
            quiet = not events and not self.frames.sending() and not self.frames.backlog
            if self.draining_until and (quiet or now >= self.draining_until):
                self.frames.flush_all(DRAIN_S)
                self.log.info("drained: stopping for the next daemon", connections=len(self.frames.conns))
                return EXIT_OK
            if now >= next_chores:  # once a second: stalled frames, the store's health and figures
                next_chores = now + 1.0
                self.frames.tick(now)
                self.tasks.maintain()

    def _on_supervisor(self, _events: int) -> None:
        message = channel.recv(self.sock)
        if isinstance(message, channel.Stop) and message.drain and not self.draining_until:
            self.frames.stop_listening()  # clients that connect now are refused, and try the next daemon
            self.selector.unregister(self.sock)
            self.tasks.handing_over = True
            self.draining_until = time.monotonic() + DRAIN_S
        elif message is None or isinstance(message, channel.Stop):
            self.status = EXIT_OK
