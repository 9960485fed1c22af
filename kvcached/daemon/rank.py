"""A rank worker: a child of the supervisor that allocates and holds one rank's arenas.

The worker talks to the supervisor over a SOCK_SEQPACKET socket pair, one JSON object per packet:

    worker -> supervisor   {"t": "allocating", "total": N}    before reserving
                           {"t": "progress", "done": n}       while reserving (at most every 100 ms)
                           {"t": "ready", "dev_name": ..., "dev_bytes": ..., "cpu_name": ..., ...}
                           {"t": "failed", "error": "...", "exit": status}
                           {"t": "hb"}                         every HEARTBEAT_S while serving
    supervisor -> worker   {"t": "stop"}                       (EOF means the same)

The worker never writes the control block (the supervisor is its only writer) and never unlinks: the
supervisor knows every name and removes them all, also after a worker was killed.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import mmap
import os
import selectors
import signal
import socket
import time
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import posix_ipc
import structlog

from kvcached import logs
from kvcached.config import StoreConfig
from kvcached.daemon.access import Access
from kvcached.daemon.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, EXIT_RESOURCES
from kvcached.daemon.faults import fault
from kvcached.daemon.server import TaskServer
from kvcached.memory.host import ShmFull, create_arena, pin
from kvcached.memory.xpu import PaddleXpuRuntime, XpuDevice, XpuUnavailable
from kvcached.protocol.layout import LAYOUT_VERSION, cpu_pool_bytes, device_arena_bytes, round_up
from kvcached.protocol.names import XPU_PREFIX, arena_name, task_socket_path
from kvcached.protocol.spec import CacheSpec
from kvcached.store.base import HEADER_SIZE as STORE_HEADER_SIZE
from kvcached.store.base import ObjectIdentity, Store, StoreUnavailable
from kvcached.store.file import FileStore, RankDirectoryBusy
from kvcached.store.mooncake import MooncakeStore
from kvcached.transfer import SwapEngine

HEARTBEAT_S = 1.0
_PR_SET_PDEATHSIG = 1
MAX_PACKET = 1 << 16


def send_msg(sock: socket.socket, **msg: Any) -> None:
    """Send one message (a JSON object) as one packet."""
    sock.send(json.dumps(msg, separators=(",", ":")).encode())


def recv_msg(sock: socket.socket) -> dict[str, Any] | None:
    """Receive one message; None on EOF (the peer is gone)."""
    try:
        data = sock.recv(MAX_PACKET)
    except ConnectionResetError:
        return None
    if not data:
        return None
    msg = json.loads(data)
    assert isinstance(msg, dict)
    return msg


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGKILL us when the supervisor dies, then close the race with its death."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(EXIT_FAILURE)


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


def worker_main(sock: socket.socket, *, parent: int, plan: WorkerPlan, stats: memoryview) -> NoReturn:
    """Entry point in the forked child. Never returns: exits with a status for the supervisor's log.
    ``stats`` is the rank's slot in the control block, the only part of it the worker writes."""
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the supervisor's to handle
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    os.umask(0o077)
    structlog.contextvars.bind_contextvars(rank=plan.rank)
    log = logs.get("kvcached.rank")
    status = EXIT_FAILURE
    try:
        status = _serve(sock, plan, stats, log)
    except BaseException as exc:  # the process ends here either way; say why first
        log.exception("rank worker crashed")
        with contextlib.suppress(OSError):
            send_msg(sock, t="failed", error=f"worker crashed: {exc!r}", exit=EXIT_FAILURE)
    finally:
        os._exit(status)


def _open_store(
    config: StoreConfig, spec: CacheSpec, rank: int, ranks: int, log: Any
) -> tuple[Store | None, np.ndarray[Any, Any] | None]:
    """This rank's attention store client and its page-aligned staging buffer (one object), or (None, None)."""
    if config.backend is None:
        return None, None
    identity = ObjectIdentity(spec.geometry_digest, rank, spec.block_bytes)
    staging = np.frombuffer(mmap.mmap(-1, round_up(STORE_HEADER_SIZE + spec.block_bytes)), dtype=np.uint8)
    staging = staging[: STORE_HEADER_SIZE + spec.block_bytes]
    if config.backend == "file":
        store: Store = FileStore(Path(config.path), identity=identity, capacity=config.capacity // ranks, log=log)
        log.info("file store opened", path=config.path, objects=store.counters.objects, bytes=store.counters.bytes)
    else:
        store = MooncakeStore(
            identity=identity,
            master=config.mooncake_master,
            metadata=config.mooncake_metadata,
            segment_bytes=config.mooncake_segment,
            staging=staging,
            log=log,
        )
    return store, staging


def _serve(sock: socket.socket, plan: WorkerPlan, stats: memoryview, log: Any) -> int:
    instance, generation, rank, spec, access = plan.instance, plan.generation, plan.rank, plan.spec, plan.access
    dev_name = arena_name(instance, generation, rank, "dev")
    cpu_name = arena_name(instance, generation, rank, "cpu")
    dev_bytes, cpu_bytes = device_arena_bytes(spec), cpu_pool_bytes(spec)
    total = dev_bytes + cpu_bytes
    send_msg(sock, t="allocating", total=total)
    fault("worker-allocating")

    last_sent = 0.0

    def progress(base: int) -> Any:
        def report(done: int) -> None:
            nonlocal last_sent
            now = time.monotonic()
            if now - last_sent >= 0.1 or base + done == total:
                last_sent = now
                send_msg(sock, t="progress", done=base + done)

        return report

    xpu: XpuDevice | None = None
    if plan.memory == "xpu":
        try:
            xpu = XpuDevice(spec, rank, plan.device_id, PaddleXpuRuntime())
        except XpuUnavailable as exc:
            send_msg(sock, t="failed", error=str(exc), exit=EXIT_CONFIG)
            return EXIT_CONFIG
        dev_name = f"{XPU_PREFIX}{plan.device_id}"
        progress(0)(dev_bytes)
    try:
        device = (
            None
            if xpu is not None
            else create_arena(dev_name, dev_bytes, progress(0), mode=access.mode, gid=access.gid)
        )
        pool = (
            create_arena(cpu_name, cpu_bytes, progress(dev_bytes), mode=access.mode, gid=access.gid)
            if cpu_bytes
            else None
        )
    except ShmFull as exc:
        send_msg(sock, t="failed", error=str(exc.strerror), exit=EXIT_RESOURCES)
        return EXIT_RESOURCES
    except posix_ipc.ExistentialError:
        send_msg(sock, t="failed", error=f"arena name taken by another process: {dev_name}", exit=EXIT_RESOURCES)
        return EXIT_RESOURCES
    if xpu is not None and pool is not None:
        try:
            pin(pool)  # the device copies to and from it by DMA, as FastDeploy's mlocked swap space
        except OSError as exc:
            send_msg(sock, t="failed", error=f"CPU pool of rank {rank}: {exc.strerror}", exit=EXIT_RESOURCES)
            return EXIT_RESOURCES
    log.info("arenas reserved", device_bytes=dev_bytes, cpu_bytes=cpu_bytes)

    try:
        store, staging = _open_store(plan.store, spec, rank, plan.ranks, log)
    except (RankDirectoryBusy, OSError, StoreUnavailable) as exc:
        send_msg(sock, t="failed", error=f"attention store: {exc}", exit=EXIT_CONFIG)
        return EXIT_CONFIG

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    socket_path = task_socket_path(plan.run_dir, instance, rank)
    listener.bind(str(socket_path))
    access.apply_socket(socket_path)
    listener.listen(64)
    listener.setblocking(False)
    server = TaskServer(
        listener=listener,
        engine=SwapEngine(spec, xpu.pieces if xpu is not None else device, pool),
        stats=stats,
        rank=rank,
        generation=generation,
        log=log,
        store=store,
        staging=staging.data if staging is not None else None,
        access=access,
    )
    fault("worker-before-ready")
    send_msg(
        sock,
        t="ready",
        dev_name=dev_name,
        dev_bytes=dev_bytes,
        cpu_name=cpu_name if cpu_bytes else "",
        cpu_bytes=cpu_bytes,
        layout_version=LAYOUT_VERSION,
    )

    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, "supervisor")
    selector.register(listener, selectors.EVENT_READ, "listener")
    next_beat = time.monotonic() + HEARTBEAT_S
    while True:
        for key, _ in selector.select(timeout=max(0.0, next_beat - time.monotonic())):
            if key.data == "supervisor":
                msg = recv_msg(sock)
                if msg is None or msg.get("t") == "stop":
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
            send_msg(sock, t="hb")
            next_beat = now + HEARTBEAT_S
