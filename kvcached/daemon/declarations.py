"""``--geometry engine``: the daemon waits for the engine to declare the cache's geometry, then allocates exactly that.

FastDeploy profiles by default and fixes its block count only afterwards, so the operator cannot know it when starting
kvcached. With ``--geometry engine`` the supervisor, after taking the lock and reclaiming (``held`` first gives it the
geometry an earlier run's memory was made for, so that memory is adopted as any other), calls ``await_declaration`` when
it adopted nothing:

1. it publishes a control block whose spec names the store backend only, every rank EMPTY (``Pending``), so runners, the
   FastDeploy drop-in and ``kvcached status`` see a live daemon and where it listens;
2. it serves ``<run_dir>/<instance>.declare.sock`` (``Declarations``): each connection, from the daemon's user or its
   ``--group`` (peer credentials), sends one spec and is answered accepted, refused (naming the field: ``judge`` refuses
   one when the fixed condition gives the runner the cache, when the store's options or /dev/shm cannot hold it), or
   busy (past ``MAX_OPEN`` connections: the declarer asks again, within its own deadline). The first that fits is
   accepted; every other declaration whose message the daemon holds is then judged against it, equal accepted, different
   refused by name: two different declarations arriving together are never both accepted;
3. on acceptance it marks every rank KEPT (waiters look for the next block), removes that block, and the supervisor
   starts as if the spec had been configured: the next block publishes it.

Declarations after that are judged by their senders against the published header (``kvcached.protocol.declare``): equal
adopts, different is refused by name. A stop, keep or restart signal while waiting ends the wait (a restart executes the
daemon again, which waits again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import select
import socket
import time
from pathlib import Path

from kvcached import logs
from kvcached.access import Access, Peer, peer_of
from kvcached.checks import counted
from kvcached.config import DaemonConfig
from kvcached.daemon import requests
from kvcached.daemon.notify import Notifier
from kvcached.daemon.ranks import create_semaphores, remove_semaphores
from kvcached.memory.shm import shm_free_bytes
from kvcached.protocol import framing
from kvcached.protocol.control import ControlBlock, Record, State
from kvcached.protocol.declare import WHAT, declare_socket_path, parse_declaration
from kvcached.protocol.errors import InvalidSpec, KVCacheError
from kvcached.protocol.instance import open_instance
from kvcached.protocol.ownership import cache_owner, explain_owner
from kvcached.protocol.proc import self_identity
from kvcached.protocol.spec import CacheSpec

#: What the waiting daemon's header note and `kvcached status` say.
WAITING_NOTE = "waiting for the engine to declare the geometry (--geometry engine)"
#: Seconds one declaring connection may take to send its whole spec.
READ_S = 2.0
#: Declaring connections served at once. Past it, the one silent the longest (at least ``SILENT_S``: a declarer sends
#: its spec as it connects) is answered busy and closed for room, else the newcomer is: a neighbour holding the slots
#: with connections that never speak, however often it reconnects, loses them to the declarers that speak.
MAX_OPEN = 32
SILENT_S = 0.1
#: The answer to a connection past ``MAX_OPEN``: not a refusal, the declarer asks again.
BUSY = {"accepted": False, "busy": True, "message": f"{MAX_OPEN} declarations under way; ask again"}

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
    try:
        return config.declared(CacheSpec.from_dict(published)) if "num_blocks" in published else config
    except InvalidSpec:
        return config


def same(accepted: DaemonConfig, spec: CacheSpec) -> DaemonConfig | Refusal:
    """``accepted`` when ``spec`` equals the declaration it took (every declared field), else why not."""
    differs = spec.first_difference(accepted.spec.to_dict(), CacheSpec.DECLARED_FIELDS)
    if differs is None:
        return accepted
    field, theirs, ours = differs
    return field, theirs, ours, f"another declaration was accepted first: {field} is {theirs!r} in it, {ours!r} here"


def judge(config: DaemonConfig, spec: CacheSpec) -> DaemonConfig | Refusal:
    """The configuration that serves the declared ``spec``, or why not (naming the field)."""
    try:
        declared = config.declared(spec)
    except InvalidSpec as exc:
        return exc.field, None, getattr(spec, exc.field, None), exc.message
    if cache_owner(declared.spec) == "runner":
        ours = config.spec.storage_backend
        if spec.storage_backend and spec.storage_backend != ours:  # the store it counts on is not this daemon's
            why = f"the spec declares store {spec.storage_backend}, this daemon has {ours or 'none'}: start it with it"
            return "storage_backend", ours, spec.storage_backend, why
        why = f"{explain_owner(declared.spec)}: the runner owns the cache, kvcached has nothing to hold"
        return "num_cpu_blocks", "> 0 (or a store, or a prefill/decode role)", spec.num_cpu_blocks, why
    need, per_rank = declared.shm_need()
    free = shm_free_bytes()
    if need > free:
        ranks = counted(declared.ranks, "rank")
        why = f"/dev/shm has {free} bytes free, this geometry needs {need} ({ranks} x {per_rank})"
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
            mode=access.read_mode,
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


@dataclasses.dataclass(slots=True)
class _Declaring:
    """One declaring connection: who it is, until when it may send, what it sent so far."""

    conn: socket.socket
    peer: Peer
    deadline: float
    frames: framing.Reader = dataclasses.field(default_factory=lambda: framing.Reader(framing.DECLARATION, WHAT))
    heard: float = dataclasses.field(default_factory=time.monotonic)  # when it connected or last sent a byte


class Declarations:
    """The declaration socket: one spec per connection, answered as soon as it is whole. Connections are
    served side by side, never blocking: each has ``READ_S`` seconds for its whole message, so one that sends
    slowly (or nothing) costs only itself, never the daemon's other declarations or its signals."""

    def __init__(self, run_dir: Path, instance: str, access: Access, log: logs.Logger) -> None:
        self.path = declare_socket_path(run_dir, instance)
        self.access, self.log = access, log
        self.path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(self.path))
        access.apply_socket(self.path)
        self.sock.listen(64)
        self.sock.setblocking(False)
        self.open: dict[int, _Declaring] = {}

    def fds(self) -> list[int]:
        return [self.sock.fileno(), *self.open]

    def timeout(self, longest: float) -> float:
        """Seconds to wait at most: ``longest``, or less when a connection's time runs out before."""
        now = time.monotonic()
        return max(0.0, min([longest, *(d.deadline - now for d in self.open.values())]))

    def serve(self, readable: list[int], config: DaemonConfig) -> DaemonConfig | None:
        """Accept new connections, read what the others sent, answer each whole message, close connections past their
        time: the configuration of an accepted declaration, if one was (after it, each message is judged against it)."""
        accepted = None
        for fd in [fd for fd in readable if fd in self.open]:  # first: what is sent is never a silent slot
            accepted = self._receive(self.open[fd], config, accepted) or accepted
        if self.sock.fileno() in readable:
            self._accept()
            for fd in [fd for fd in self.open if fd not in readable]:  # the new ones: most sent as they came
                accepted = self._receive(self.open[fd], config, accepted) or accepted
        now = time.monotonic()
        for fd, late in list(self.open.items()):
            if now >= late.deadline:
                why = f"no whole declaration within {READ_S:g}s"
                self.log.warning("declaration refused", pid=late.peer.pid, reason=why)
                self._close(fd, {"accepted": False, "field": "spec", "message": why})
        return accepted

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors: the open connections end within READ_S
                self.log.warning("declaration not accepted", reason=os.strerror(exc.errno or 0))
                return
            peer = peer_of(conn)
            if not self.access.allows(peer):
                self.log.warning("declaration refused: not the daemon's user or group", pid=peer.pid, uid=peer.uid)
                why = f"uid {peer.uid} is neither the daemon's user nor in its group"
                _answer(conn, {"accepted": False, "field": "access", "message": why})
                continue
            if len(self.open) >= MAX_OPEN and not self._evict_silent():
                _answer(conn, BUSY)
                continue
            conn.setblocking(False)
            self.open[conn.fileno()] = _Declaring(conn, peer, time.monotonic() + READ_S)

    def _evict_silent(self) -> bool:
        """Answer busy and close the connection silent the longest, if for ``SILENT_S`` at least; whether one was."""
        now = time.monotonic()
        fd, quiet = min(((fd, d) for fd, d in self.open.items()), key=lambda item: item[1].heard)
        if now - quiet.heard < SILENT_S:
            return False
        self.open.pop(fd)
        _answer(quiet.conn, BUSY)
        return True

    def _receive(
        self, declaring: _Declaring, config: DaemonConfig, accepted: DaemonConfig | None
    ) -> DaemonConfig | None:
        """Read what came; judge and answer the message once whole (or it cannot be), against ``accepted`` if set."""
        fd = declaring.conn.fileno()
        try:
            chunk = declaring.conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            chunk = b""
        declaring.frames.feed(chunk)
        declaring.heard = time.monotonic()
        try:
            spec = parse_declaration(declaring.frames)
            if spec is None and not chunk:
                raise InvalidSpec("spec", "the connection ended before a whole declaration")
            if spec is None:
                return None
        except InvalidSpec as exc:
            self.log.warning("declaration refused", pid=declaring.peer.pid, field=exc.field, reason=exc.message)
            self._close(fd, {"accepted": False, "field": exc.field, "message": str(exc)})
            return None
        except Exception as exc:  # a message no check foresaw: refused, the daemon waits on
            self.log.exception("declaration refused: it could not be read", pid=declaring.peer.pid)
            self._close(fd, {"accepted": False, "field": "spec", "message": f"it could not be read: {exc!r:.200}"})
            return None
        return self._judge(fd, declaring.peer, spec, config, accepted)

    def _judge(
        self, fd: int, peer: Peer, spec: CacheSpec, config: DaemonConfig, accepted: DaemonConfig | None
    ) -> DaemonConfig | None:
        try:
            verdict = judge(config, spec) if accepted is None else same(accepted, spec)
        except Exception as exc:  # a spec no check foresaw: refused, the daemon waits on
            self.log.exception("declaration refused: it could not be judged", pid=peer.pid)
            verdict = "spec", None, None, f"it could not be judged: {exc!r:.200}"
        if isinstance(verdict, DaemonConfig):
            self._close(fd, {"accepted": True})
            if accepted is None:
                self.log.info("geometry declared", pid=peer.pid, spec=json.dumps(verdict.spec.to_dict()))
            return verdict
        field, ours, theirs, why = verdict
        self.log.warning("declaration refused", pid=peer.pid, field=field, reason=why)
        self._close(fd, {"accepted": False, "field": field, "daemon": ours, "declared": theirs, "message": why})
        return None

    def _close(self, fd: int, reply: dict[str, object]) -> None:
        _answer(self.open.pop(fd).conn, reply)

    def close(self, accepted: DaemonConfig | None = None) -> None:
        """Stop listening. With ``accepted``, every declaration already sent (on an open connection, or one still in the
        listening backlog) is answered against it first; the rest are closed unanswered: their declarers look for the
        block that follows (``kvcached.protocol.declare.declare`` returns False) and judge against it."""
        if accepted is not None:
            self._accept()
            for declaring in list(self.open.values()):  # each closes its own connection only
                self._receive(declaring, accepted, accepted)
        for declaring in self.open.values():
            declaring.conn.close()
        self.open.clear()
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
                wait = point.timeout(notify.ping_interval() or 1.0)
                poller = select.poll()  # poll: no limit on descriptor numbers
                for fd in [*point.fds(), wake_fd]:
                    poller.register(fd, select.POLLIN)
                readable = [fd for fd, _ in poller.poll(wait * 1000)]
                accepted = point.serve(readable, config)
                if wake_fd in readable and accepted is None:
                    accepted = _stop_signal(wake_fd, log)
        finally:
            pending.retire(handed_on=isinstance(accepted, DaemonConfig))
    finally:
        point.close(accepted if isinstance(accepted, DaemonConfig) else None)
    return accepted


def _answer(conn: socket.socket, reply: dict[str, object]) -> None:
    """Send ``reply`` if the socket takes it at once (it is small), and close."""
    with contextlib.suppress(OSError):
        conn.send(framing.frame(framing.encode(reply)), socket.MSG_DONTWAIT)
    conn.close()


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
