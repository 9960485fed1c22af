"""The instance lock file, ``<run_dir>/<instance>.lock``: held with flock by the supervisor for its whole life, and
holding one line, ``"<pid> <start time>\\n"``, the holder's identity (``kvcached.protocol.proc``).

This module is the only one that knows that format. The run directory is checked before anything is opened in it: a real
directory (not a symlink), owned by the daemon's user, not writable by others; the lock file itself is opened with
``O_NOFOLLOW``, so a symlink planted in its place is refused, never followed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import stat
import time
from pathlib import Path

from kvcached.protocol.errors import ResourceError
from kvcached.protocol.names import open_plain
from kvcached.protocol.proc import is_alive, self_identity, start_time, status_values

_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW


@dataclasses.dataclass(frozen=True, slots=True)
class Holder:
    """Who holds (or last held) a lock file."""

    pid: int
    started: int

    @property
    def alive(self) -> bool:
        return is_alive(self.pid, self.started)


class Locked(Exception):
    """Another process holds the lock: ``holder`` if its line could be read; ``owner``, another user's daemon's uid."""

    def __init__(self, holder: Holder | None, owner: int | None = None) -> None:
        super().__init__(f"held by pid {holder.pid}" if holder else "held by another process")
        self.holder = holder
        self.owner = owner


def prepare_run_dir(directory: Path, gid: int | None = None) -> None:
    """Create ``directory`` (mode 0700) if missing, then check it: a directory, not a symlink, owned by this user, not
    writable by others. With ``gid`` the group's runners must reach the sockets in it: it gains search permission for
    its group when that is ``gid``, else for everyone (search, not listing: each socket keeps its own group and mode
    0660, and every connection's peer is checked). Its group is never changed: instances with other groups may share it.
    Raises ``ResourceError`` saying what is wrong."""
    if not directory.is_absolute():
        raise ResourceError(f"run directory {directory} is relative: set KVCACHED_RUN_DIR to an absolute path")
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        pass  # not a directory: reported below
    except OSError as exc:
        raise ResourceError(f"cannot create run directory {directory}: {exc.strerror}") from None
    st = directory.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise ResourceError(f"run directory {directory} is {kind}; point KVCACHED_RUN_DIR at a directory")
    if st.st_uid != os.geteuid():
        raise ResourceError(f"run directory {directory} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & stat.S_IWOTH:
        raise ResourceError(f"run directory {directory} is writable by anyone (mode {stat.S_IMODE(st.st_mode):o})")
    if gid is not None:
        search = stat.S_IXGRP if st.st_gid == gid else stat.S_IXGRP | stat.S_IXOTH
        if st.st_mode & search != search:
            os.chmod(directory, stat.S_IMODE(st.st_mode) | search)


def acquire(path: Path, *, mode: int = 0o600, gid: int | None = None) -> int:
    """Take the lock at ``path`` (mode ``mode``, group ``gid`` when given) and write this process's identity into it;
    the descriptor (keep it open for as long as the lock must hold). Raises ``Locked`` if another process holds it,
    ``ResourceError`` if ``path`` is not a plain file of ours (a symlink, a directory)."""
    while True:
        squatted = why_not_a_lock(path)
        if squatted:
            _raise_if_another_users_daemon(path)
            raise ResourceError(squatted)
        try:
            fd = os.open(path, _OPEN_FLAGS, mode)
        except OSError as exc:
            raise ResourceError(f"cannot open lock file {path}: {exc.strerror} (a symlink or a directory?)") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise ResourceError(f"lock file {path} is not a plain file of this user; remove it")
        os.fchmod(fd, mode)
        if gid is not None:
            os.fchown(fd, -1, gid)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _parse(os.read(fd, 64))
            os.close(fd)
            raise Locked(holder) from None
        # The holder before us may have unlinked the file as it stopped: then our lock guards nothing. Only a lock on
        # the file the path names now counts.
        try:
            same = os.stat(path, follow_symlinks=False).st_ino == st.st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    os.ftruncate(fd, 0)
    pid, started = self_identity()
    os.write(fd, f"{pid} {started}\n".encode())
    return fd


def _raise_if_another_users_daemon(path: Path) -> None:
    """Raise ``Locked`` when the file at ``path`` is a plain file whose owner's live daemon holds it (as /proc/locks
    lists it): the name is taken by a running instance of that user, not squatted."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        pid = flock_holder(path) if stat.S_ISREG(st.st_mode) else None
        if pid is not None and not why_not_daemon(pid, st.st_uid, path):
            raise Locked(Holder(pid, start_time(pid) or 0), owner=st.st_uid)


def why_not_a_lock(path: Path) -> str:
    """Why what is at ``path`` cannot be taken as this user's lock file, with what to do ("" when nothing is there or it
    is a plain file of this user): another uid's file, a symlink, a directory, ... planted there."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"cannot look at lock file {path}: {exc.strerror}"
    if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
        return ""
    kind = "a plain file" if stat.S_ISREG(st.st_mode) else "a symlink" if stat.S_ISLNK(st.st_mode) else "not a file"
    return (
        f"{path} is {kind} of uid {st.st_uid} (mode {stat.S_IMODE(st.st_mode):o}), not a kvcached lock of this "
        f"user (uid {os.geteuid()}): it holds the instance's name. Remove it (`rm {path}`, as root or uid "
        f"{st.st_uid}) once you know whose it is, or pick another --instance name"
    )


def still_ours(path: Path, fd: int) -> bool:
    """Whether ``fd``, left open across its exec by an earlier image of this process, is this user's lock file at
    ``path`` with its lock held by this process: then it is taken as it is."""
    try:
        st, there = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or not os.path.samestat(st, there):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by this open file already: granted at once
    except OSError:
        return False
    return True


def release(path: Path, fd: int) -> None:
    """Remove the lock file, then drop the lock: a starter that opened the old file sees it unlinked and retries."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)


def holder(path: Path) -> Holder | None:
    """The identity written in the lock file at ``path`` (held or not), or None."""
    try:
        fd = open_plain(path)
    except OSError:
        return None
    try:
        return _parse(os.read(fd, 64))
    finally:
        os.close(fd)


def held_by(path: Path) -> Holder | None:
    """The process holding the lock at ``path`` now (a daemon starting up, before its control block exists; pid -1 while
    its line is not written), or None."""
    try:
        fd = open_plain(path)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _parse(os.read(fd, 64)) or Holder(-1, 0)
    finally:
        os.close(fd)
    return None


def _parse(raw: bytes) -> Holder | None:
    fields = raw.decode(errors="replace").split()
    if len(fields) >= 2 and fields[0].isdigit() and fields[1].isdigit():
        return Holder(int(fields[0]), int(fields[1]))
    return None


def flock_holder(path: Path, locks: str = "/proc/locks") -> int | None:
    """The pid holding a flock on the file at ``path`` as the kernel lists it (``/proc/locks``), or None. Needs no
    permission to open the file: how another user sees that a daemon holds its lock."""
    try:
        st = os.stat(path, follow_symlinks=False)
        lines = Path(locks).read_text().splitlines()
    except OSError:
        return None
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        fields = line.split()
        if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == where and fields[4].isdigit():
            return int(fields[4])
    return None


def why_not_daemon(pid: int, owner: int, lock: Path) -> str:
    """Why process ``pid`` is not to be trusted as the daemon whose lock is ``lock`` and whose files ``owner`` (a uid)
    owns ("" when it is): it must run as ``owner``, be ``kvcached start`` (or the image a restart executed), and hold
    the flock on ``lock`` as the kernel lists it (held across a restart's exec too; when nobody holds it, the first two
    checks suffice). A file anyone else could write names no pid worth a signal: the callers check the files first
    (``why_untrusted_file``)."""
    uid = process_uid(pid)
    if uid is None:
        return f"pid {pid} is gone"
    if uid != owner:
        return f"pid {pid} runs as uid {uid}, not as uid {owner} that owns the instance's files"
    if not is_kvcached_daemon(pid):
        return f"pid {pid} is not a kvcached daemon"
    locker = flock_holder(lock)
    if locker is not None and locker != pid:
        return f"pid {locker}, not pid {pid}, holds {lock}"
    return ""


def why_untrusted_file(path: Path, owner: int | None = None) -> str:
    """Why the file (or directory) at ``path`` cannot be believed ("" when it can): a symlink, writable by group or
    others, or not owned by ``owner`` (when given)."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink"
    if owner is not None and st.st_uid != owner:
        return f"{path} belongs to uid {st.st_uid}, not to uid {owner}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def process_uid(pid: int) -> int | None:
    uids = status_values(pid, "Uid")  # real, effective, saved, filesystem
    return int(uids[1]) if len(uids) > 1 else None


def is_kvcached_daemon(pid: int) -> bool:
    """Whether process ``pid`` runs ``kvcached start`` (``kvcached`` or ``python -m kvcached.cli``). A command line read
    empty while it lives is read again for up to a second: a restart's ``execv`` empties it for a moment (the locks stay
    held)."""
    for _ in range(100):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            return False
        if argv != [""] or process_uid(pid) is None:
            break
        time.sleep(0.01)
    for at, arg in enumerate(argv):
        if arg == "kvcached.cli" or os.path.basename(arg) == "kvcached":
            return "start" in argv[at + 1 :]
    return False
