"""The steps of a daemon's start, each raising ``Fatal`` with the exit status its failure deserves
(``kvcached.daemon.exits``). ``Supervisor._start`` takes them in this order, the fault-injection points of
``kvcached.daemon.faults`` between them:

1. refuse a spec for which the runner owns the cache (``refuse_runner_owned``);
2. take the instance's locks (``Locks``), or exit 3 and touch nothing;
3. adopt what an earlier run of this instance left, or reclaim it (``reclaim``); with ``--geometry engine`` and nothing
   adopted, wait for the engine to declare the geometry (``kvcached.daemon.declarations``);
4. check /dev/shm has room for every rank and tier it does not adopt, before anything is reserved (``check_space``), and
   what the store's options name (``check_store``);
5. create the semaphores and the control block (``stage_block``, ``Supervisor._create_objects``), and fork one worker
   per rank (``Supervisor._spawn``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from kvcached import logs, native, store
from kvcached.access import Access
from kvcached.checks import counted
from kvcached.config import DaemonConfig
from kvcached.daemon import lockfile, shutdown
from kvcached.daemon.adopt import Adoption, Refusal, conform, judge, new_shm_need, start_note
from kvcached.daemon.exits import EXIT_ALREADY_RUNNING, EXIT_CONFIG, EXIT_RESOURCES, Fatal
from kvcached.daemon.handover import Handover, refusal_path
from kvcached.daemon.ranks import stop_children
from kvcached.daemon.reclaim import Leftovers, inspect_instance, remove_leftovers
from kvcached.memory.shm import shm_free_bytes
from kvcached.protocol.control import MAX_RUN_DIR, ControlBlock
from kvcached.protocol.errors import ResourceError
from kvcached.protocol.layout import size_text
from kvcached.protocol.names import (
    MAX_SOCKET_PATH,
    control_name,
    instance_lock_path,
    lock_path,
    shm_path,
    task_socket_path,
)
from kvcached.protocol.ownership import DAEMON_OWNS_WITH, cache_owner, explain_owner
from kvcached.protocol.proc import self_identity
from kvcached.protocol.spec import CacheSpec

#: Seconds between tries of a metrics port that was taken when a restart's image started.
METRICS_RETRY_S = 2.0


def refuse_runner_owned(spec: CacheSpec) -> None:
    """A spec for which the runner owns the cache has nothing for a daemon to hold."""
    if cache_owner(spec) == "runner":
        raise Fatal(
            f"refusing to allocate: {explain_owner(spec)}. A daemon-owned copy would be a second "
            f"cache on the device. Enable {DAEMON_OWNS_WITH} for the daemon to own it.",
            EXIT_CONFIG,
        )


#: The lock files' descriptors an image hands the next across a restart's exec ("<fd> <path>" lines).
LOCKS_ENV = "KVCACHED_HELD_LOCKS"


class Locks:
    """The lock files a supervisor holds for its whole life, across a restart's exec too (``pass_on``):
    ``<run_dir>/<instance>.lock``, then the instance's own (one daemon per instance on the host, whatever run directory
    each was given: a second one's reclaim must never see the first one's fresh objects as leftovers)."""

    def __init__(self, instance: str) -> None:
        self.instance = instance
        self.fds: dict[Path, int] = {}
        self.inherited = _inherited_locks()

    @property
    def held(self) -> bool:
        return bool(self.fds)

    def take(self, ranks: int, access: Access) -> None:
        path = lock_path(self.instance)
        directory = path.parent
        longest = task_socket_path(directory, self.instance, ranks - 1)
        if len(str(directory).encode()) > MAX_RUN_DIR or len(str(longest).encode()) > MAX_SOCKET_PATH:
            raise Fatal(
                f"run directory {directory} is too long for Unix socket paths ({longest} needs at most "
                f"{MAX_SOCKET_PATH} bytes); set KVCACHED_RUN_DIR to a shorter directory",
                EXIT_CONFIG,
            )
        try:
            lockfile.prepare_run_dir(directory, access.gid)
            self._take(path)
            self._take(instance_lock_path(self.instance), mode=access.read_mode, gid=access.group)
        except ResourceError as exc:
            raise Fatal(str(exc), EXIT_RESOURCES) from None

    def _take(self, where: Path, *, mode: int = 0o600, gid: int | None = None) -> None:
        fd = self.inherited.pop(where, None)
        # Only a descriptor that is this user's lock file there, locked by this process, is taken; any other is left as
        # it is (a garbage variable must not close a descriptor of this image's).
        if fd is not None and _handed_on(fd) and lockfile.still_ours(where, fd):
            os.set_inheritable(fd, False)
            os.fchmod(fd, mode)  # as a file made now would be: a restart may change or drop --group
            os.fchown(fd, -1, os.getegid() if gid is None else gid)
            self.fds[where] = fd
            return
        try:
            self.fds[where] = lockfile.acquire(where, mode=mode, gid=gid)
        except lockfile.Locked as locked:
            who = f"pid {locked.holder.pid}" if locked.holder else "another process"
            then = f"use another --instance name, or `kvcached stop --instance {self.instance}`"
            if locked.owner is not None:
                who, then = f"{who}, a daemon of uid {locked.owner},", "the name is that user's: use another one"
            raise Fatal(
                f"instance {self.instance!r} is already running ({who} holds {where}); {then}",
                EXIT_ALREADY_RUNNING,
            ) from None

    def release(self) -> None:
        """Let go of them, the run directory's last."""
        for path, fd in reversed(self.fds.items()):
            lockfile.release(path, fd)
        self.fds.clear()

    def pass_on(self) -> None:
        """Keep them held, and open across a restart's exec, for the next image (``LOCKS_ENV``): the name is never free
        in between; if the exec fails the process ends and the files are free to the next start."""
        for fd in self.fds.values():
            os.set_inheritable(fd, True)
        os.environ[LOCKS_ENV] = "".join(f"{fd} {path}\n" for path, fd in self.fds.items())
        self.fds.clear()


def _inherited_locks() -> dict[Path, int]:
    """The lock descriptors the image before left this one (``LOCKS_ENV``, removed from the environment: no child sees
    it); those not taken by ``Locks._take`` stay open until this process ends."""
    held: dict[Path, int] = {}
    for line in os.environ.pop(LOCKS_ENV, "").splitlines():
        fd, _, path = line.partition(" ")
        if fd.isascii() and fd.isdigit() and len(fd) < 10 and path:
            held[Path(path)] = int(fd)
    return held


def _handed_on(fd: int) -> bool:
    """Whether ``fd`` can be a lock ``Locks.pass_on`` left open across the exec: above the standard three, open and
    inheritable (none this image opened itself is: a garbage or hostile ``LOCKS_ENV`` must not make it close its own
    epoll, pipes, stdout or stderr)."""
    try:
        return fd > 2 and os.get_inheritable(fd)
    except OSError:
        return False


def reclaim(
    config: DaemonConfig, run_dir: Path, access: Access, handover: Handover, log: logs.Logger, *, grace_s: float
) -> tuple[Adoption | None, str]:
    """Adopt what an earlier run of this instance left, if ``kvcached.daemon.adopt`` allows, with this start's mode and
    group (``conform``); remove the rest, but what ``_refuse_the_unusable`` refuses or leaves. The workers the image
    before handed over are taken first (``handover``), stopped when their memory is not adopted. Returns the adoption,
    if any, and the start's note for ``kvcached status``."""
    found = inspect_instance(config.instance, run_dir)
    control = _refuse_the_unusable(found, config.instance, log)
    handover.take(config.instance)
    fresh = config.fresh and not handover.restarted
    if config.fresh and handover.restarted:
        log.info("--fresh applies to the start it was given to, not to a restart: adopting the memory")
    verdict = None if fresh else judge(config)
    if handover.restarted and isinstance(verdict, Refusal):
        raise Fatal(
            f"restart refused: the memory would not be adopted ({verdict.reason}); the configuration changed "
            "after the restart checked it. The memory is kept, as a crash leaves it: `kvcached start` with the "
            "configuration it ran with adopts it; `kvcached stop`, then a start, rebuilds it",
            EXIT_CONFIG,
        )
    adoption = verdict if isinstance(verdict, Adoption) else None
    keep: set[Path] = {refusal_path(run_dir, config.instance)} if handover.restarted else set()
    if adoption is not None:
        ours = f".{adoption.arena_id:016x}."
        keep |= {entry for entry in found.entries if ours in entry.name and not entry.name.startswith("sem.")}
        keep |= {control} | {task_socket_path(run_dir, config.instance, rank) for rank in handover.predecessors}
        log.info("adopting the memory of an earlier run", note=adoption.note)
    elif isinstance(verdict, Refusal):
        log.warning("not adopting the memory of an earlier run; reclaiming it", reason=verdict.reason)
    elif fresh and found.entries:
        verdict = Refusal(0, "--fresh")
    handed = bool(handover.predecessors) and adoption is not None
    note = start_note(verdict, [path for path, _ in found.squatters], handed_over=handed)
    if handover.predecessors and adoption is None:
        log.warning("stopping the last image's workers: their memory is not adopted")
        stop_children(handover.drop_predecessors(), grace_s=grace_s, drain=False)
    if count := remove_leftovers(found, keep=keep):
        log.info("reclaimed objects of an earlier run", count=count)
    gone, problems = shutdown.release_stores(config.instance, run_dir, but=config.store.backend)
    if gone or problems:
        log.warning(
            "let go of what another storage backend kept for an earlier run (this one uses "
            f"{config.store.backend or 'none'})",
            files=gone,
            problems=problems,
        )
    if adoption is not None:
        try:
            conform(config, adoption, access)
        except OSError as exc:
            raise Fatal(f"cannot give the adopted memory this start's mode and group: {exc}", EXIT_RESOURCES) from None
    return adoption, note


def _refuse_the_unusable(found: Leftovers, instance: str, log: logs.Logger) -> Path:
    """Refuse a live instance under another run directory, and someone else's object at the control block's name; report
    someone else's objects under other names (left untouched). The control block's path."""
    if found.live_pid is not None:
        raise Fatal(
            f"instance {instance!r} is live (daemon pid {found.live_pid}) under another run directory "
            f"than {lock_path(instance).parent}",
            EXIT_ALREADY_RUNNING,
        )
    control = shm_path(control_name(instance))
    for path, why in found.squatters:
        if path == control:
            raise Fatal(why, EXIT_RESOURCES)
        log.warning("left untouched: an object under this instance's names is not ours", reason=why)
    return control


def check_space(config: DaemonConfig, adoption: Adoption | None) -> None:
    need = new_shm_need(config, adoption)
    free = shm_free_bytes()
    if need > free:
        adopted = " besides the memory it adopts" if adoption is not None else ""
        raise Fatal(
            f"/dev/shm has {size_text(free)} free, this configuration needs {size_text(need)}{adopted} "
            f"({counted(config.ranks, 'rank')} x {size_text(config.shm_need()[1])}); enlarge /dev/shm (docker "
            "--shm-size, mount -o remount,size=...) or lower --num-blocks / --num-cpu-blocks / --ranks",
            EXIT_RESOURCES,
        )


def check_store(config: DaemonConfig, log: logs.Logger) -> None:
    chosen = config.store
    if chosen.backend is None:
        return
    try:
        warnings = store.get(chosen.backend).start_warnings(chosen.options, config.ranks)
    except OSError as exc:  # a path its options name cannot even be looked at (too long, ...)
        raise Fatal(f"attention store {chosen.backend}: {exc.strerror}: {exc.filename}", EXIT_CONFIG) from None
    for warning in warnings:
        log.warning("attention store", warning=warning)


def log_start(config: DaemonConfig, note: str, log: logs.Logger) -> None:
    log.info(
        "starting",
        ranks=config.ranks,
        memory=config.memory,
        owner=explain_owner(config.spec),
        per_rank=size_text(config.shm_need()[1]),
        glibc_tunables=os.environ.get("GLIBC_TUNABLES", ""),
        copy_engine=native.describe(),
        **({"note": note} if note else {}),
    )
    for ignored in config.ignored:
        log.warning("option ignored", reason=ignored)


def stage_block(
    config: DaemonConfig, generation: int, arena_id: int, adoption: Adoption | None, note: str
) -> ControlBlock:
    """The control block of the run ``generation``, under its staging name: the supervisor writes every record, then
    ``install``s it under the public name (over the adopted run's block)."""
    pid, started = self_identity()
    access = Access.for_daemon(config.gid)
    return ControlBlock.create(
        config.instance,
        generation=generation,
        spec=config.spec,
        num_ranks=config.ranks,
        daemon_pid=pid,
        daemon_start=started,
        run_dir=str(lock_path(config.instance).parent),
        mode=access.read_mode,
        gid=access.group,
        adopted_from=adoption.generation if adoption is not None else 0,
        arena_id=arena_id,
        note=note,
        staged=True,
    )


class MetricsEndpoint:
    """The metrics endpoint (``--metrics-port``), serving on a thread of the supervisor once ``open``. A port someone
    else holds is a configuration error at a start; a restart's image never ends the cache over it: it serves on without
    the endpoint, saying so, and tries the port again every ``METRICS_RETRY_S`` (``retry_if_due``, quietly)."""

    def __init__(self, config: DaemonConfig, log: logs.Logger) -> None:
        self.config, self.log = config, log
        self.server: Any = None
        self.block: ControlBlock | None = None
        self.tried = 0.0
        self.why = ""  # why the port could not be listened on

    def open(self, block: ControlBlock, *, restarted: bool) -> None:
        """Listen, after the first workers are forked (which so copy no thread of it; replacements are forked while it
        runs: a fork copies only the forking thread, and a worker takes none of its locks)."""
        if not self.config.metrics_port:
            return
        self.block = block
        if self._try():
            return
        if not restarted:
            raise Fatal(f"{self.why}; pick a free port or 0 for none", EXIT_CONFIG)
        self.log.warning(f"{self.why}; serving without metrics, trying the port again every {METRICS_RETRY_S:.0f}s")

    def retry_if_due(self) -> None:
        if self.block is not None and self.server is None and time.monotonic() - self.tried >= METRICS_RETRY_S:
            self._try()

    def _try(self) -> bool:
        from kvcached.daemon import metrics

        assert self.block is not None
        address, port = self.config.metrics_address, self.config.metrics_port
        self.tried = time.monotonic()
        try:
            self.server = metrics.serve(self.config.instance, self.block, self.config.memory, address, port)
        except OSError as exc:
            self.why = f"--metrics-port: cannot listen on {address}:{port}: {exc.strerror}"
            return False
        self.log.info("metrics endpoint", url=f"http://{address}:{port}/metrics")
        return True

    def close(self) -> None:
        self.block = None
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
