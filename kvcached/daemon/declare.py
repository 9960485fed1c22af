"""``--geometry engine``: the daemon waits for the engine to declare the cache's geometry, then allocates
exactly that.

FastDeploy profiles by default and fixes its block count only afterwards, so the operator cannot know it
when starting kvcached. With ``--geometry engine`` the supervisor, after taking the lock and reclaiming
(``held`` first gives it the geometry an earlier run's memory was made for, so that memory is adopted as
any other), calls ``await_declaration`` when it adopted nothing:

1. it publishes a control block whose spec names the store backend only, every rank EMPTY (``Pending``),
   so runners, the FastDeploy drop-in and ``kvcached status`` see a live daemon and where it listens;
2. it serves ``<run_dir>/<instance>.declare.sock`` (``Declarations``): each connection, from the daemon's
   user or its ``--group`` (peer credentials), sends one spec; ``judge`` refuses one by name when the
   fixed condition gives the runner the cache, when the store's options or /dev/shm cannot hold it, and
   accepts the first that fits;
3. on acceptance it marks every rank KEPT (waiters look for the next block), removes that block, and the
   supervisor starts as if the spec had been configured: the next block publishes it.

Declarations after that are judged by their senders against the published header
(``kvcached.protocol.declare``): equal adopts, different is refused by name. A stop, keep or restart
signal while waiting ends the wait (a restart executes the daemon again, which waits again).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import select
import socket
from pathlib import Path

from kvcached import logs
from kvcached.access import Access, peer_of
from kvcached.config import DaemonConfig
from kvcached.daemon import requests
from kvcached.daemon.notify import Notifier
from kvcached.daemon.ranks import create_semaphores, remove_semaphores
from kvcached.memory.shm import shm_free_bytes
from kvcached.protocol.control import ControlBlock, Record, State
from kvcached.protocol.declare import declare_socket_path, read_message
from kvcached.protocol.errors import InvalidSpec, KVCacheError
from kvcached.protocol.instance import open_instance
from kvcached.protocol.ownership import cache_owner, explain_owner
from kvcached.protocol.proc import self_identity
from kvcached.protocol.spec import CacheSpec

#: What the waiting daemon's header note and `kvcached status` say.
WAITING_NOTE = "waiting for the engine to declare the geometry (--geometry engine)"
#: Seconds one declaring connection may take to send its spec.
READ_S = 2.0

Refusal = tuple[str, object, object, str]  # field, the daemon's value, the declared value, why


def held(config: DaemonConfig) -> DaemonConfig:
    """``config`` with the geometry of the memory an earlier run of the instance left (its control block's
    spec), so that the start can adopt it; ``config`` itself when there is none or it does not fit."""
    if config.geometry != "engine":
        return config
    try:
        view = open_instance(config.instance)
    except KVCacheError:
        return config
    if view is None:
        return config
    with view:
        published = view.header.spec if view.header is not None else {}
    if "num_blocks" not in published:
        return config
    try:
        return config.declared(CacheSpec.from_dict(published))
    except InvalidSpec:
        return config


def judge(config: DaemonConfig, spec: CacheSpec) -> DaemonConfig | Refusal:
    """The configuration that serves the declared ``spec``, or why not (naming the field)."""
    try:
        declared = config.declared(spec)
    except InvalidSpec as exc:
        return exc.field, None, getattr(spec, exc.field, None), exc.message
    if cache_owner(declared.spec) == "runner":
        why = f"{explain_owner(declared.spec)}: the runner owns the cache, kvcached has nothing to hold"
        return "num_cpu_blocks", "> 0 (or a store, or a prefill/decode role)", spec.num_cpu_blocks, why
    need, per_rank = declared.shm_need()
    free = shm_free_bytes()
    if need > free:
        why = f"/dev/shm has {free} bytes free, this geometry needs {need} ({declared.ranks} ranks x {per_rank})"
        return "num_blocks", free, spec.num_blocks, why
    return declared


class Pending:
    """The control block of a daemon waiting for the geometry: the store backend as spec, every rank EMPTY."""

    def __init__(self, config: DaemonConfig, run_dir: Path, access: Access) -> None:
        self.instance = config.instance
        self.generation = secrets.randbits(64) | 1
        self.sems = create_semaphores(self.instance, self.generation, config.ranks, access)
        pid, started = self_identity()
        self.block = ControlBlock.create(
            self.instance,
            generation=self.generation,
            spec=None,
            known={"storage_backend": config.spec.storage_backend},
            num_ranks=config.ranks,
            daemon_pid=pid,
            daemon_start=started,
            run_dir=str(run_dir),
            mode=access.mode,
            gid=access.gid,
            note=WAITING_NOTE,
        )

    def retire(self, *, handed_on: bool) -> None:
        """Remove the block and semaphores; with ``handed_on`` the ranks are KEPT first, so that waiters
        look for the block that follows."""
        if handed_on:
            for rank, sem in enumerate(self.sems):
                self.block.write(rank, Record(state=State.KEPT, rank=rank, generation=self.generation))
                sem.release()
        self.block.unlink()
        self.block.close()
        remove_semaphores(self.sems)


class Declarations:
    """The declaration socket: one spec per connection, answered at once."""

    def __init__(self, run_dir: Path, instance: str, access: Access, log: logs.Logger) -> None:
        self.path = declare_socket_path(run_dir, instance)
        self.access, self.log = access, log
        self.path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(self.path))
        access.apply_socket(self.path)
        self.sock.listen(64)
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno()

    def take(self, config: DaemonConfig) -> DaemonConfig | None:
        """Answer one waiting connection; the configuration for its spec when it was accepted."""
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return None
        with conn:
            conn.settimeout(READ_S)
            peer = peer_of(conn)
            if not self.access.allows(peer):
                self.log.warning("declaration refused: not the daemon's user or group", pid=peer.pid, uid=peer.uid)
                return None
            try:
                message = read_message(conn)
                spec = CacheSpec.from_dict((message or {}).get("spec") or {})
            except (OSError, InvalidSpec, TypeError) as exc:
                self._reply(conn, {"accepted": False, "field": getattr(exc, "field", "spec"), "message": str(exc)})
                return None
            verdict = judge(config, spec)
            if isinstance(verdict, DaemonConfig):
                self._reply(conn, {"accepted": True})
                self.log.info("geometry declared", pid=peer.pid, spec=json.dumps(verdict.spec.to_dict()))
                return verdict
            field, ours, theirs, why = verdict
            self.log.warning("declaration refused", pid=peer.pid, field=field, reason=why)
            self._reply(conn, {"accepted": False, "field": field, "daemon": ours, "declared": theirs, "message": why})
            return None

    @staticmethod
    def _reply(conn: socket.socket, message: dict[str, object]) -> None:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps(message, default=str).encode() + b"\n")

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)


def await_declaration(
    config: DaemonConfig, run_dir: Path, access: Access, *, wake_fd: int, notify: Notifier, log: logs.Logger
) -> DaemonConfig | int:
    """Publish the waiting ranks and serve declarations until one is accepted: its configuration. A stop,
    keep or restart signal ends the wait: its number."""
    point = Declarations(run_dir, config.instance, access, log)  # listening before the block shows it
    accepted: DaemonConfig | int | None = None
    try:
        pending = Pending(config, run_dir, access)
        try:
            log.info(WAITING_NOTE, socket=str(point.path), ranks=config.ranks)
            notify.send(READY=1, STATUS=WAITING_NOTE)
            while accepted is None:
                notify.ping_if_due()
                readable, _, _ = select.select([point.fileno(), wake_fd], [], [], notify.ping_interval() or 1.0)
                if point.fileno() in readable:
                    accepted = point.take(config)
                if wake_fd in readable and accepted is None:
                    accepted = _stop_signal(wake_fd, log)
        finally:
            pending.retire(handed_on=isinstance(accepted, DaemonConfig))
    finally:
        point.close()
    return accepted


def _stop_signal(wake_fd: int, log: logs.Logger) -> int | None:
    """The first stop, keep or restart signal the wake-up pipe carries; others are logged or ignored."""
    try:
        data = os.read(wake_fd, 512)
    except BlockingIOError:
        return None
    for signum in data:
        if signum in (*requests.STOP_SIGNALS, requests.KEEP_SIGNAL, requests.RESTART_SIGNAL):
            log.info("stopping while waiting for the geometry", signal=requests.name(signum))
            return signum
        if signum == requests.LOG_SIGNAL:
            log.info(WAITING_NOTE)
    return None
