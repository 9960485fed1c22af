"""A rank worker: a child of the supervisor that allocates and holds one rank's tiers and serves its tasks.

Its life, in three steps, each raising ``WorkerFailure`` (a reason and the exit status the daemon should
end with) when it cannot go on:

1. ``allocate``: the device tier (through its backend, ``kvcached.memory``) and the CPU pool, reporting
   progress;
2. ``open_store``: this rank's client of the attention store, if any (``kvcached.store``);
3. ``serve``: listen on the rank's task socket and run tasks (``kvcached.daemon.server``) until told to
   stop.

The worker talks to the supervisor through ``kvcached.daemon.channel``. It never writes a rank record
(the supervisor is the records' only writer; the worker writes its own stats slot) and never unlinks:
the supervisor knows every name and removes them all, also after a worker was killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import mmap
import os
import selectors
import signal
import socket
import time
from typing import NoReturn

import posix_ipc
import structlog

from kvcached import logs, memory, store
from kvcached.access import Access
from kvcached.config import StoreConfig
from kvcached.daemon import channel
from kvcached.daemon.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, EXIT_RESOURCES
from kvcached.daemon.faults import fault
from kvcached.daemon.server import TaskServer
from kvcached.memory.base import DeviceTier, TierRequest
from kvcached.memory.shm import create_arena, pin
from kvcached.protocol.errors import BackendUnavailable, ResourceError, ShmFull, StoreBusy, StoreUnavailable
from kvcached.protocol.layout import LAYOUT_VERSION, cpu_pool_bytes
from kvcached.protocol.names import task_socket_path
from kvcached.protocol.spec import CacheSpec
from kvcached.protocol.stats import StatsSlot
from kvcached.store.base import ObjectIdentity, Store
from kvcached.transfer import SwapEngine

HEARTBEAT_S = 1.0
_PR_SET_PDEATHSIG = 1


class WorkerFailure(Exception):
    """The worker cannot go on: ``reason`` goes to the supervisor, which ends with ``exit_status``."""

    def __init__(self, reason: str, exit_status: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.exit_status = exit_status


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerPlan:
    """What a rank worker is told when it is forked: which rank of which run, how to allocate and serve it."""

    instance: str
    generation: int
    rank: int
    ranks: int
    spec: CacheSpec
    run_dir: str
    store: StoreConfig
    access: Access
    memory: str = "host"
    device_id: int = 0

    def tier_request(self) -> TierRequest:
        return TierRequest(
            instance=self.instance,
            arena_id=self.generation,
            rank=self.rank,
            spec=self.spec,
            device_id=self.device_id,
            mode=self.access.mode,
            gid=self.access.gid,
        )


@dataclasses.dataclass(slots=True)
class RankTiers:
    """A rank's memory as its worker holds it."""

    device: DeviceTier
    pool: mmap.mmap | None
    pool_name: str


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGKILL us when the supervisor dies, then close the race with its death."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(EXIT_FAILURE)


def worker_main(sock: socket.socket, *, parent: int, plan: WorkerPlan, stats: StatsSlot) -> NoReturn:
    """Entry point in the forked child. Never returns: exits with a status for the supervisor's log.
    ``stats`` is the rank's slot in the control block, the only part of it the worker writes."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the supervisor's to handle
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_DFL)
    os.umask(0o077)
    structlog.contextvars.bind_contextvars(rank=plan.rank)
    log = logs.get("kvcached.worker")
    status = EXIT_FAILURE
    try:
        tiers = allocate(sock, plan, log)
        rank_store = open_store(plan, log)
        status = serve(sock, plan, tiers, rank_store, stats=stats, log=log)
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
        os._exit(status)


def allocate(sock: socket.socket, plan: WorkerPlan, log: logs.Logger) -> RankTiers:
    """Create the rank's device tier and CPU pool, reporting progress to the supervisor."""
    backend = memory.get(plan.memory)
    request = plan.tier_request()
    spec = plan.spec
    dev_bytes, cpu_bytes = backend.arena_bytes(spec), cpu_pool_bytes(spec)
    total = dev_bytes + cpu_bytes
    channel.send(sock, channel.Allocating(total))
    fault("worker-allocating")
    last_sent = 0.0

    def progress(base: int) -> memory.base.Progress:
        def report(done: int) -> None:
            nonlocal last_sent
            now = time.monotonic()
            if now - last_sent >= 0.1 or base + done == total:
                last_sent = now
                channel.send(sock, channel.Progress(base + done))

        return report

    pool_name = request.shm_name("cpu")
    try:
        device = backend.create(request, progress(0))
        pool = (
            create_arena(pool_name, cpu_bytes, progress(dev_bytes), mode=request.mode, gid=request.gid)
            if cpu_bytes
            else None
        )
    except BackendUnavailable as exc:
        raise WorkerFailure(str(exc), EXIT_CONFIG) from None
    except ShmFull as exc:
        raise WorkerFailure(str(exc.strerror), EXIT_RESOURCES) from None
    except ResourceError as exc:
        raise WorkerFailure(str(exc), EXIT_RESOURCES) from None
    except posix_ipc.ExistentialError:
        raise WorkerFailure(f"arena name taken by another process: {pool_name}", EXIT_RESOURCES) from None
    if backend.pins_pool and pool is not None:
        try:
            pin(pool)  # the device copies to and from it by DMA, as FastDeploy's mlocked swap space
        except OSError as exc:
            raise WorkerFailure(f"CPU pool of rank {plan.rank}: {exc.strerror}", EXIT_RESOURCES) from None
    log.info("tiers reserved", device_bytes=device.nbytes, cpu_bytes=cpu_bytes, backend=plan.memory)
    return RankTiers(device, pool, pool_name if pool is not None else "")


def open_store(plan: WorkerPlan, log: logs.Logger) -> Store | None:
    """This rank's attention store client, or None without a store."""
    if plan.store.backend is None:
        return None
    identity = ObjectIdentity(plan.spec.geometry_digest, plan.rank, plan.spec.block_bytes)
    try:
        return store.get(plan.store.backend).open(
            plan.store.options, identity=identity, rank=plan.rank, ranks=plan.ranks, log=log
        )
    except (StoreBusy, StoreUnavailable, OSError) as exc:
        raise WorkerFailure(f"attention store: {exc}", EXIT_CONFIG) from None


def serve(
    sock: socket.socket,
    plan: WorkerPlan,
    tiers: RankTiers,
    rank_store: Store | None,
    *,
    stats: StatsSlot,
    log: logs.Logger,
) -> int:
    """Listen on the rank's task socket, report READY, and run tasks until the supervisor says stop."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    socket_path = task_socket_path(plan.run_dir, plan.instance, plan.rank)
    listener.bind(str(socket_path))
    plan.access.apply_socket(socket_path)
    listener.listen(64)
    listener.setblocking(False)
    server = TaskServer(
        listener=listener,
        engine=SwapEngine(plan.spec, tiers.device.pieces, tiers.pool),
        stats=stats,
        rank=plan.rank,
        generation=plan.generation,
        log=log,
        store=rank_store,
        access=plan.access,
    )
    fault("worker-before-ready")
    channel.send(
        sock,
        channel.Ready(
            backend=plan.memory,
            descriptor=dict(tiers.device.descriptor),
            dev_bytes=tiers.device.nbytes,
            cpu_name=tiers.pool_name,
            cpu_bytes=len(tiers.pool) if tiers.pool is not None else 0,
            layout_version=LAYOUT_VERSION,
        ),
    )
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, "supervisor")
    selector.register(listener, selectors.EVENT_READ, "listener")
    next_beat = time.monotonic() + HEARTBEAT_S
    while True:
        for key, _ in selector.select(timeout=max(0.0, next_beat - time.monotonic())):
            if key.data == "supervisor":
                message = channel.recv(sock)
                if message is None or isinstance(message, channel.Stop):
                    return EXIT_OK
            elif key.data == "listener":
                conn = server.accept()
                if conn is not None:
                    selector.register(conn, selectors.EVENT_READ, "client")
            else:
                client = key.fileobj
                assert isinstance(client, socket.socket)
                if not server.on_readable(client):
                    selector.unregister(client)
                    server.close(client)
        now = time.monotonic()
        if now >= next_beat:  # also after a long copy: the supervisor must not take us for hung
            channel.send(sock, channel.Heartbeat())
            next_beat = now + HEARTBEAT_S
