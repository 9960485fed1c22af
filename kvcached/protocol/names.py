"""Names of every shared object of an instance, and where the run directory is.

An instance name is ``[A-Za-z0-9_][A-Za-z0-9_-]{0,47}`` (no dot, no leading "-"), so every object name
parses unambiguously::

    /kvcached.<instance>                          control block (fixed name: runners find it)
    /kvcached.<instance>.<gen>.ctl                a new control block before it takes that name (a start
                                                  writes it whole, then renames it over the last one's)
    /kvcached.<instance>.<gen>.r<rank>            per-rank wake-up semaphore (/dev/shm/sem.kvcached...)
    /kvcached.<instance>.<gen>.r<rank>.dev        device arena of a rank (host backend)
    /kvcached.<instance>.<gen>.r<rank>.cpu        CPU swap pool of a rank
    /kvcached.<instance>.<gen>.r<rank>.keys       key directory of a rank's CPU pool
    /dev/shm/kvcached.<instance>.lock             flock held by the supervisor: one daemon per instance on the
                                                  host, whatever run directory each was given
    <run_dir>/<instance>.lock                     flock held by the supervisor for its whole life
    <run_dir>/<instance>.r<rank>.sock             a rank worker's task socket (Unix stream)

``<gen>`` is a daemon generation in 16 hex digits: a semaphore carries the generation that made it, an arena, pool or
key directory the generation that allocated it (its arena id). A daemon that adopted the memory of an earlier generation
keeps that generation's arena names; nothing of a dead run ever carries the name of a new generation.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import tempfile
from pathlib import Path

from kvcached.protocol.errors import InvalidSpec

PREFIX = "kvcached"
SHM_DIR = Path("/dev/shm")
DEFAULT_INSTANCE = "default"
_INSTANCE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,47}")
#: What an instance name may be, as error messages and --help say it (not beginning with "-": such a name
#: reads as an option on every command line that names it).
INSTANCE_RULE = "1-48 characters of A-Z a-z 0-9 _ -, not beginning with -"
#: The instance a runner uses when it names none (``kvcached`` reads it too): else ``DEFAULT_INSTANCE``.
INSTANCE_ENV = "KVCACHED_INSTANCE"


def instance_or_default(instance: str | None = None) -> str:
    """``instance``, or ``$KVCACHED_INSTANCE``, or ``default``; checked (``InvalidSpec`` naming the source). The one
    place the default is worked out: set empty, the variable counts as unset, as the CLI reads it (click ignores it)."""
    if instance is not None:
        return check_instance(instance)
    named = os.environ.get(INSTANCE_ENV)
    return check_instance(named, field=INSTANCE_ENV) if named else DEFAULT_INSTANCE


def check_instance(instance: str, *, field: str = "instance") -> str:
    """Return ``instance`` if it is a valid instance name, else raise ``InvalidSpec`` naming ``field`` and the rule."""
    if not isinstance(instance, str) or not _INSTANCE_RE.fullmatch(instance):
        raise InvalidSpec(field, f"must be {INSTANCE_RULE}, got {instance!r}")
    return instance


def control_name(instance: str) -> str:
    """POSIX shm name of the instance's control block."""
    return f"/{PREFIX}.{check_instance(instance)}"


def staged_control_name(instance: str, generation: int) -> str:
    """POSIX shm name under which ``generation`` writes its control block before giving it the public name."""
    return f"/{PREFIX}.{check_instance(instance)}.{generation:016x}.ctl"


def semaphore_name(instance: str, generation: int, rank: int) -> str:
    """POSIX semaphore name of a rank's wake-up semaphore in one generation."""
    return f"/{PREFIX}.{check_instance(instance)}.{generation:016x}.r{rank}"


def arena_name(instance: str, generation: int, rank: int, tier: str) -> str:
    """POSIX shm name of a rank's arena of ``tier`` ("dev", "cpu" or "keys") allocated by ``generation``."""
    return f"/{PREFIX}.{check_instance(instance)}.{generation:016x}.r{rank}.{tier}"


def instance_shm_entries(instance: str) -> list[Path]:
    """Every entry of /dev/shm that belongs to ``instance`` (any generation), shm and semaphores, sorted."""
    return instances_in_shm().get(check_instance(instance), [])


def instances_in_shm() -> dict[str, list[Path]]:
    """Every instance with an entry in /dev/shm, whoever made it, and its entries (as
    ``instance_shm_entries`` lists them): the names are host-wide, readable by all."""
    try:
        names = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return {}
    found: dict[str, list[Path]] = {}
    for name in names:
        parts = name.removeprefix("sem.").split(".")
        if len(parts) > 1 and parts[0] == PREFIX and _INSTANCE_RE.fullmatch(parts[1]):
            found.setdefault(parts[1], []).append(SHM_DIR / name)
    return found


def open_plain(path: Path | str, flags: int = os.O_RDONLY) -> int:
    """Open ``path`` (an object under /dev/shm, or a lock file) as a plain file, or raise ``OSError``: as ``os.open``
    does (``FileNotFoundError``, ``PermissionError``, ``ELOOP`` for a symbolic link), and EINVAL for anything not a
    regular file (a FIFO, a socket, a directory: anyone may make one at any name; a FIFO's open waits forever)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def shm_path(name: str) -> Path:
    """Where POSIX shared memory object ``name`` ("/kvcached...") lies: under /dev/shm."""
    return SHM_DIR / name.lstrip("/")


def posix_name(entry: Path) -> tuple[str, bool]:
    """The POSIX name of a /dev/shm entry and whether it is a semaphore."""
    if entry.name.startswith("sem."):
        return "/" + entry.name[4:], True
    return "/" + entry.name, False


def run_dir() -> Path:
    """Where lock files and sockets live: ``$KVCACHED_RUN_DIR`` if set; ``$RUNTIME_DIRECTORY`` under systemd
    (``/run/kvcached``); ``$XDG_RUNTIME_DIR/kvcached``; else ``<tmp>/kvcached-<uid>``."""
    if explicit := os.environ.get("KVCACHED_RUN_DIR"):
        return Path(explicit).absolute()  # published in the control block: it must mean the same to runners
    if systemd := os.environ.get("RUNTIME_DIRECTORY"):
        return Path(systemd.split(":")[0])
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return Path(xdg) / PREFIX
    return Path(tempfile.gettempdir()) / f"{PREFIX}-{os.geteuid()}"


def instance_lock_path(instance: str) -> Path:
    """The host-wide instance lock in /dev/shm (a plain file the supervisor holds with flock)."""
    return SHM_DIR / f"{PREFIX}.{check_instance(instance)}.lock"


def lock_path(instance: str) -> Path:
    """The supervisor's lock file of ``instance``."""
    return run_dir() / f"{check_instance(instance)}.lock"


#: Longest path a Unix socket address holds (sun_path, with its terminating NUL).
MAX_SOCKET_PATH = 107


def task_socket_path(run_dir: str | Path, instance: str, rank: int) -> Path:
    """Path of rank ``rank``'s task socket. The run directory comes from the control block header, so
    a runner finds it whatever its own environment says."""
    return Path(run_dir) / f"{check_instance(instance)}.r{rank}.sock"
