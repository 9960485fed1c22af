"""The supervisor: holds the instance lock, owns the control block, spawns and watches rank workers.

Start-up, in this order (each step is a fault-injection point, see ``kvcached.daemon.faults``):

1. refuse a spec for which the runner owns the cache (the fixed condition, cited in the message);
2. take ``<run_dir>/<instance>.lock`` with flock, or exit 3 and touch nothing;
3. reclaim what a dead run of this instance left in /dev/shm (ours only; a foreign owner or foreign
   permissions on one of our names is refused, never used or deleted);
4. check /dev/shm has room for every rank and tier, before anything is reserved;
5. create the per-rank semaphores, then the control block (published last: magic);
6. fork one worker per rank; each record goes ALLOCATING, then READY when its worker has reserved.

The supervisor is the control block's only writer. Signal handlers only enqueue (Python writes the
signal number to a wake-up pipe); the main loop dispatches. On SIGTERM/SIGINT/SIGHUP every record goes
STOPPING (and its semaphore is posted), workers are stopped, and every object of the instance is
unlinked, the lock file last.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import secrets
import selectors
import signal
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Any

import posix_ipc
import structlog

from kvcached import logs
from kvcached.config import DaemonConfig
from kvcached.daemon import faults
from kvcached.daemon.access import Access
from kvcached.daemon.errors import (
    EXIT_ALREADY_RUNNING,
    EXIT_CONFIG,
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_RESOURCES,
    Fatal,
)
from kvcached.daemon.fdsignals import FastDeploySignals, SignalError
from kvcached.daemon.notify import Notifier
from kvcached.daemon.rank import HEARTBEAT_S, WorkerPlan, recv_msg, send_msg, worker_main
from kvcached.memory import host
from kvcached.protocol.control import MAX_RUN_DIR, ControlBlock, Record, State
from kvcached.protocol.layout import rank_shm_bytes
from kvcached.protocol.names import (
    MAX_SOCKET_PATH,
    SHM_DIR,
    arena_name,
    instance_shm_entries,
    lock_path,
    posix_name,
    semaphore_name,
    task_socket_path,
)
from kvcached.protocol.ownership import cache_owner, explain_owner
from kvcached.protocol.proc import is_alive, self_identity

#: A worker silent for this long (no heartbeat) is taken as hung.
HEARTBEAT_TIMEOUT_S = 10 * HEARTBEAT_S
#: How long stopping workers may take before they are killed.
STOP_GRACE_S = 5.0
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


@dataclasses.dataclass(slots=True)
class Leftovers:
    """What an instance has in /dev/shm and its run directory, as found by ``inspect_instance``."""

    entries: list[Path]
    sockets: list[Path]
    #: One message per object under our names that is not ours (foreign owner or mode): never touched.
    squatters: list[str]
    #: The daemon of a published control block, if it is alive (then nothing here is a leftover).
    live_pid: int | None


def inspect_instance(instance: str, run_dir: Path) -> Leftovers:
    """The objects of ``instance`` (any generation) and whether a live daemon owns them."""
    live_pid = None
    existing = ControlBlock.open(instance)
    if existing is not None:
        try:
            if existing.published:
                header = existing.header()
                if is_alive(header.daemon_pid, header.daemon_start):
                    live_pid = header.daemon_pid
        except Exception:
            pass
        finally:
            existing.close()
    entries = instance_shm_entries(instance)
    me = os.geteuid()
    squatters = []
    for entry in entries:
        st = entry.lstat()
        if st.st_uid != me or not stat.S_ISREG(st.st_mode) or stat.S_IMODE(st.st_mode) not in (0o600, 0o660):
            squatters.append(
                f"{entry} is not ours (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}; kvcached makes "
                f"uid {me}, mode 600 or 660): refusing to use or delete it. Remove it if it is stale, or pick "
                "another --instance name."
            )
    sockets = sorted(run_dir.glob(f"{instance}.r*.sock"))
    return Leftovers(entries, sockets, squatters, live_pid)


def unlink_entries(entries: list[Path]) -> None:
    """Unlink /dev/shm entries (shm objects or semaphores); ones already gone are skipped."""
    for entry in entries:
        name, is_sem = posix_name(entry)
        with contextlib.suppress(posix_ipc.ExistentialError):
            if is_sem:
                posix_ipc.unlink_semaphore(name)
            else:
                posix_ipc.unlink_shared_memory(name)


def remove_leftovers(found: Leftovers) -> int:
    """Unlink what ``inspect_instance`` found (never with a live daemon or a squatter); how many."""
    assert found.live_pid is None and not found.squatters
    unlink_entries(found.entries)
    for path in found.sockets:
        path.unlink(missing_ok=True)
    return len(found.entries) + len(found.sockets)


class Supervisor:
    """One daemon instance. ``run()`` returns the exit status; everything created is gone by then."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.spec = config.spec
        self.instance = config.instance
        self.log = logs.get("kvcached.supervisor")
        self.generation = 0
        self.lock_fd: int | None = None
        self.block: ControlBlock | None = None
        self.sems: list[posix_ipc.Semaphore] = []
        self.records: list[Record] = []
        self.workers: dict[int, tuple[int, socket.socket]] = {}  # rank -> (pid, socket)
        self.heard: dict[int, float] = {}  # rank -> monotonic time of the last message
        self.selector = selectors.DefaultSelector()
        self.run_dir = lock_path(config.instance).parent
        self.wake_r, self.wake_w = -1, -1
        self.all_ready_logged = False
        self.notify = Notifier()
        self.tty = sys.stderr.isatty()  # allocation progress for a person watching the terminal
        self.last_shown = 0.0
        self.access = Access.for_daemon(config.gid)
        self.metrics: Any = None  # the metrics HTTP server, when --metrics-port is set
        self.signals: FastDeploySignals | None = None  # FastDeploy's flags, when --ipc-suffix is set

    # -- entry ----------------------------------------------------------------------------------------

    def run(self) -> int:
        """Start, serve until told to stop or a rank fails, clean up; return the exit status."""
        structlog.contextvars.bind_contextvars(instance=self.instance)
        self._install_signals()
        status = EXIT_FAILURE
        try:
            self._start()
            status = self._loop()
        except Fatal as fatal:
            self.log.error("fatal", reason=fatal.reason, exit_status=fatal.exit_status)
            self.notify.send(STATUS=f"failed: {fatal.reason}")
            status = fatal.exit_status
            raise
        finally:
            self.notify.send(STOPPING=1)
            self._cleanup()
            self.notify.close()
            self.log.info("stopped", exit_status=status)
        return status

    def _install_signals(self) -> None:
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        for signum in (*_STOP_SIGNALS, signal.SIGCHLD):
            signal.signal(signum, lambda *_: None)  # the wake-up fd carries the signal number
        self.selector.register(self.wake_r, selectors.EVENT_READ, None)

    # -- start-up -------------------------------------------------------------------------------------

    def _start(self) -> None:
        spec = self.spec
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
        self._check_space()
        if self.config.ipc_suffix is not None:
            self.signals = FastDeploySignals(self.config.ipc_suffix, self.config.ranks, self.access)
            try:
                self.signals.open()  # every rank 0 before anything can be READY
            except (SignalError, posix_ipc.Error, OSError) as exc:
                self.signals = None
                raise Fatal(f"--ipc-suffix: {exc}", EXIT_RESOURCES) from None
        self.generation = secrets.randbits(64) | 1
        structlog.contextvars.bind_contextvars(generation=f"{self.generation:016x}")
        for rank in range(self.config.ranks):
            name = semaphore_name(self.instance, self.generation, rank)
            self.sems.append(posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0))
            self.access.apply(SHM_DIR / f"sem.{name.lstrip('/')}")
        faults.fault("after-semaphores")
        pid, started = self_identity()
        self.block = ControlBlock.create(
            self.instance,
            generation=self.generation,
            spec=spec,
            num_ranks=self.config.ranks,
            daemon_pid=pid,
            daemon_start=started,
            run_dir=str(self.run_dir),
            mode=self.access.mode,
            gid=self.access.gid,
        )
        self.records = [Record(rank=r, generation=self.generation) for r in range(self.config.ranks)]
        faults.fault("after-control-block")
        self.log.info(
            "starting",
            ranks=self.config.ranks,
            memory=self.config.memory,
            owner=explain_owner(spec),
            per_rank=_mib(rank_shm_bytes(spec)),
            glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""),
        )
        for rank in range(self.config.ranks):
            self._spawn(rank)
        if self.config.metrics_port:  # after the forks: its thread must not be copied into workers
            self._serve_metrics()

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
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        owner = directory.stat().st_uid
        if owner != os.geteuid():
            raise Fatal(f"run directory {directory} belongs to uid {owner}, not to this user", EXIT_RESOURCES)
        if self.access.gid is not None:  # the group's runners must reach the sockets in it
            os.chown(directory, -1, self.access.gid)
            os.chmod(directory, stat.S_IMODE(directory.stat().st_mode) | stat.S_IXGRP)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").split()
                os.close(fd)
                who = f"pid {holder[0]}" if holder else "another process"
                raise Fatal(
                    f"instance {self.instance!r} is already running ({who} holds {path}); "
                    f"use another --instance name, or `kvcached stop --instance {self.instance}`",
                    EXIT_ALREADY_RUNNING,
                ) from None
            # The holder before us may have unlinked the file as it stopped: then our lock guards
            # nothing. Only a lock on the file the path names now counts.
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        pid, started = self_identity()
        os.write(fd, f"{pid} {started}\n".encode())
        self.lock_fd = fd

    def _reclaim(self) -> None:
        """Remove what a dead run of this instance left; refuse squatters and live instances."""
        found = inspect_instance(self.instance, self.run_dir)
        if found.live_pid is not None:
            raise Fatal(
                f"instance {self.instance!r} is live (daemon pid {found.live_pid}) under another run directory "
                f"than {self.run_dir}",
                EXIT_ALREADY_RUNNING,
            )
        if found.squatters:
            raise Fatal(found.squatters[0], EXIT_RESOURCES)
        count = remove_leftovers(found)
        if count:
            self.log.info("reclaimed objects of a dead run", count=count)

    def _check_space(self) -> None:
        need, per_rank = self.config.shm_need()
        free = host.shm_free_bytes()
        if need > free:
            raise Fatal(
                f"/dev/shm has {_mib(free)} free, this configuration needs {_mib(need)} "
                f"({self.config.ranks} ranks x {_mib(per_rank)}); enlarge /dev/shm (docker --shm-size, "
                "mount -o remount,size=...) or lower --num-blocks / --num-cpu-blocks / --ranks",
                EXIT_RESOURCES,
            )

    def _spawn(self, rank: int) -> None:
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # child: keep nothing of the supervisor's but the socket
            parent_sock.close()
            signal.set_wakeup_fd(-1)
            for fd in (self.lock_fd, self.wake_r, self.wake_w):
                if fd is not None and fd >= 0:
                    os.close(fd)
            for _, other in self.workers.values():
                other.close()
            assert self.block is not None
            plan = WorkerPlan(
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
            )
            worker_main(child_sock, parent=parent, plan=plan, stats=self.block.stats(rank))
        child_sock.close()
        self.workers[rank] = (pid, parent_sock)
        self.heard[rank] = time.monotonic()
        self.selector.register(parent_sock, selectors.EVENT_READ, rank)
        self._set(rank, state=State.ALLOCATING, worker_pid=pid)

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
                ready = [r.state is State.READY for r in self.records]
                self.signals.update(ready, has_pool=self.spec.num_cpu_blocks > 0)

    # -- main loop ------------------------------------------------------------------------------------

    def _loop(self) -> int:
        tick = min(HEARTBEAT_S / 2, self.notify.ping_interval() or HEARTBEAT_S)
        while True:
            self.notify.ping_if_due()
            for key, _ in self.selector.select(timeout=tick):
                if key.data is None:
                    status = self._on_signals()
                    if status is not None:
                        return status
                else:
                    self._on_worker(key.data)
            self._reap()
            self._check_heartbeats()
            if self.signals is not None:
                try:
                    self.signals.tick()
                except (SignalError, posix_ipc.Error, OSError) as exc:
                    self.log.warning("cannot keep FastDeploy's ready flags in step", reason=str(exc))

    def _on_signals(self) -> int | None:
        try:
            data = os.read(self.wake_r, 512)
        except BlockingIOError:
            return None
        for signum in data:
            if signum in _STOP_SIGNALS:
                self.log.info("stopping", signal=signal.Signals(signum).name)
                return EXIT_OK
        return None

    def _on_worker(self, rank: int) -> None:
        _, sock = self.workers[rank]
        msg = recv_msg(sock)
        if msg is None:
            self.selector.unregister(sock)
            self._reap(block_s=1.0)
            raise self._rank_failed(rank, "worker closed its channel", EXIT_FAILURE)
        now = time.monotonic()
        self.heard[rank] = now
        kind = msg.get("t")
        record = self.records[rank]
        record.heartbeat_ns = time.monotonic_ns()
        if kind == "hb":
            self._set(rank)
        elif kind == "allocating":
            self._set(rank, total_bytes=int(msg["total"]))
        elif kind == "progress":
            self._set(rank, reserved_bytes=int(msg["done"]))
            self.notify.status(self._progress_text(), throttle_s=0.5)
            self._show_progress()
        elif kind == "ready":
            self._set(
                rank,
                state=State.READY,
                dev_name=msg["dev_name"],
                dev_bytes=int(msg["dev_bytes"]),
                cpu_name=msg["cpu_name"],
                cpu_bytes=int(msg["cpu_bytes"]),
                layout_version=int(msg["layout_version"]),
                reserved_bytes=record.total_bytes,
            )
            self._show_progress(force=True)
            self.log.info("rank ready", rank=rank, bytes=record.total_bytes)
            if not self.all_ready_logged and all(r.state is State.READY for r in self.records):
                self.all_ready_logged = True
                self.log.info("all ranks ready", ranks=len(self.records))
                total = sum(r.total_bytes for r in self.records)
                self.notify.send(READY=1, STATUS=f"serving {len(self.records)} ranks, {total / 2**30:.1f} GiB")
                faults.fault("after-ready")
        elif kind == "failed":
            raise self._rank_failed(rank, str(msg.get("error")), int(msg.get("exit", EXIT_FAILURE)))

    def _progress_text(self) -> str:
        ready = sum(r.state is State.READY for r in self.records)
        done = sum(r.reserved_bytes for r in self.records)
        total = rank_shm_bytes(self.spec) * len(self.records)
        gib = 2**30
        ranks = len(self.records)
        return f"allocating: {ready}/{ranks} ranks ready, {done / gib:.2f} of {total / gib:.2f} GiB reserved"

    def _show_progress(self, force: bool = False) -> None:
        """On a terminal: one line with the total and each rank's reserved share, at most 4 per second."""
        now = time.monotonic()
        if not self.tty or (not force and now - self.last_shown < 0.25):
            return
        self.last_shown = now
        shares = " ".join(
            f"r{r.rank} {'ready' if r.state is State.READY else f'{100 * r.reserved_bytes // max(r.total_bytes, 1)}%'}"
            for r in self.records
        )
        print(f"{self._progress_text()}  [{shares}]", file=sys.stderr, flush=True)

    def _rank_failed(self, rank: int, why: str, status: int) -> Fatal:
        self._set(rank, state=State.FAILED, error=why)
        return Fatal(f"rank {rank} failed: {why}", status)

    def _reap(self, block_s: float = 0.0) -> None:
        deadline = time.monotonic() + block_s
        for rank, (pid, _) in list(self.workers.items()):
            while True:
                try:
                    done, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    done, status = pid, 0
                if done or time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
            if done:
                self._forget(rank)
                how = (
                    f"killed by {signal.Signals(-os.waitstatus_to_exitcode(status)).name}"
                    if os.WIFSIGNALED(status)
                    else f"exited with status {os.waitstatus_to_exitcode(status)}"
                )
                raise self._rank_failed(rank, f"worker pid {pid} {how}", EXIT_FAILURE)

    def _forget(self, rank: int) -> None:
        _, sock = self.workers.pop(rank)
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(sock)
        sock.close()

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for rank, (pid, _) in list(self.workers.items()):
            if now - self.heard[rank] > HEARTBEAT_TIMEOUT_S and self.records[rank].state is State.READY:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                raise self._rank_failed(
                    rank, f"worker pid {pid} silent for {now - self.heard[rank]:.1f}s (hung); killed", EXIT_FAILURE
                )

    # -- stop -----------------------------------------------------------------------------------------

    def _cleanup(self) -> None:
        """Idempotent: STOPPING, stop workers, unlink every object of this generation, release the lock."""
        if self.metrics is not None:
            self.metrics.shutdown()
            self.metrics.server_close()
            self.metrics = None
        if self.block is not None:
            for rank, record in enumerate(self.records):
                if record.state is not State.FAILED:
                    self._set(rank, state=State.STOPPING)
        self._stop_workers()
        if self.signals is not None:
            self.signals.close()
            self.signals = None
        if self.lock_fd is None:
            return  # we never owned the instance: touch nothing
        if self.block is not None:
            self.block.unlink()
            self.block.close()
            self.block = None
        for sem in self.sems:
            with contextlib.suppress(posix_ipc.ExistentialError):
                sem.unlink()
            sem.close()
        self.sems = []
        if self.generation:
            for rank in range(self.config.ranks):
                for tier in ("dev", "cpu"):
                    host.unlink(arena_name(self.instance, self.generation, rank, tier))
        if self.generation:
            # Anything else of this generation (a semaphore or arena a killed worker half-made). Only
            # names with our generation: objects we refused at start-up are never ours to delete.
            ours = f".{self.generation:016x}."
            unlink_entries([entry for entry in instance_shm_entries(self.instance) if ours in entry.name])
        for path in self.run_dir.glob(f"{self.instance}.r*.sock"):
            path.unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path(self.instance))
        os.close(self.lock_fd)
        self.lock_fd = None

    def _stop_workers(self) -> None:
        for _, sock in self.workers.values():
            with contextlib.suppress(OSError):
                send_msg(sock, t="stop")
        deadline = time.monotonic() + STOP_GRACE_S
        for rank, (pid, _) in list(self.workers.items()):
            while True:
                try:
                    done, _status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    break
                if done:
                    break
                if time.monotonic() >= deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.01)
            self._forget(rank)
