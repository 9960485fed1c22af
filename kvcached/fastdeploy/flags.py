"""FastDeploy's ready flags, kept in step with the rank records (``--ipc-suffix N``).

FastDeploy's engine and runners wait on ``IPCSignal`` arrays: a POSIX shm segment
``/dev/shm/<name>.<suffix>`` (``multiprocessing.shared_memory``), viewed as ``int32[ranks]``, plain stores.
With ``--ipc-suffix N`` the supervisor maintains two of them:

- ``cache_ready_signal.N[r]`` is 1 exactly while rank r has its cache (READY, or RECOVERING: a worker
  being replaced on device memory that outlived it) in this daemon's generation, else 0 (also while an
  adopting daemon reopens the memory, and across ``kvcached restart``);
- ``swap_space_ready_signal.N[r]`` the same, for ranks that have a CPU swap pool.

Every rank's entry is written 0 before the first worker is forked, so a 1 left by a killed run is gone
before anything can be READY again.

Nobody is ever stranded on a segment FastDeploy's own habits took away:

* **Every mapping is kept in step.** The engine may re-create a segment at any time (``IPCSignal(create=
  True)`` unlinks the name and makes a new one): processes mapped to the old one keep reading it. So the
  supervisor keeps a mapping of the last ``MAX_FOLLOWED`` segments it has held under a name and writes
  each value into all of them; an older one is released (an engine re-creates its flags when it starts,
  so a waiter still mapped to a segment that many re-creations ago belongs to an engine long gone).
  The engine writes its initial values (0) into a segment it creates, after the daemon may have
  followed it: the daemon writes the values again every ``SETTLE_EVERY_S`` for the first ``SETTLE_S``
  of a segment (not after: a value the engine's own processes write later is theirs).
* **A name taken away comes back at once, as the same segment.** Every FastDeploy reader that attaches
  with ``IPCSignal(create=False)`` and exits unlinks the name (Python's resource tracker registers every
  ``SharedMemory`` it opens). The supervisor holds a second name of the current segment (a hard link,
  ``/dev/shm/kvcached.<instance>.fd.<name>``), watches /dev/shm with inotify, and links the public name
  back to the same segment: every waiter mapped to it, and every reader that opens the name next, see
  the same memory with the current values. The engine re-creating the segment must find the name free
  between its unlink and its exclusive create, so how soon depends on how the name went. FastDeploy's
  ``IPCSignal(create=True)`` opens the segment and unlinks it through that descriptor; a reader's
  resource tracker unlinks a name after the reader closed it. A name whose last event was an open
  (``ENGINE_WINDOW_S`` ago at most) is given ``ENGINE_GRACE_S``; any other, ``RELINK_GRACE_S``. A
  reader that opens the name while it is gone finds it gone, as it would without kvcached (for good). On
  a loaded host an exited reader's tracker may unlink the name only after the next reader has opened it:
  that unlink reads as the engine's, and the name is gone ``ENGINE_GRACE_S``. Telling the two apart by an
  open that follows a close failed the engine's own create (an engine re-creating its flags right after a
  reader exited), and a failed engine costs more than a reader that finds the name gone.
* **Only the engine's segments are followed.** /dev/shm is writable by every user: a segment is followed
  (mapped, written, linked) only when it is a plain shared-memory object of exactly the flag's size,
  owned by a trusted user (the daemon's, root, or ``--engine-user``) and not writable by others. Links
  are made from the descriptor of the very segment that was checked (``/proc/self/fd``), never from a
  name someone could swap meanwhile. Anything else at the name (another user's segment, a directory, a
  FIFO, a segment of another size) is logged once and left alone; the name is ours again once it is gone.
* **What the engine created is the engine's.** At stop every entry becomes 0 in every mapping; a name
  is unlinked only if this run created the segment it names now; the hidden links are removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import mmap
import os
import secrets
import stat
import struct
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kvcached.access import Access
from kvcached.protocol.errors import SignalError
from kvcached.protocol.names import PREFIX, SHM_DIR, check_instance

SIGNALS = ("cache_ready_signal", "swap_space_ready_signal")
#: A name a reader's exit took away is linked back after this long.
RELINK_GRACE_S = 0.02
#: A name unlinked through a descriptor opened just before (FastDeploy's IPCSignal(create=True): it
#: opens the segment, unlinks it, then creates the name exclusively) is left free this long for the
#: engine's create: linked back sooner, the create could find our link there and fail.
ENGINE_GRACE_S = 2.0
#: How recent that open must be (long enough for an engine preempted between the two on a loaded host). A
#: reader's own open is followed by its close before its resource tracker unlinks the name (the process
#: has exited by then), so it is never the last event before that unlink.
ENGINE_WINDOW_S = 2.0
#: FastDeploy's engine writes its initial values into a segment right after creating it: the values are
#: written again every ``SETTLE_EVERY_S`` for ``SETTLE_S`` after a new segment is followed.
SETTLE_S = 1.0
SETTLE_EVERY_S = 0.01
#: Segments of one name kept mapped (and written): the current one and those it replaced most recently.
MAX_FOLLOWED = 8

_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_IN_CLOSE = 0x00000008 | 0x00000010  # IN_CLOSE_WRITE | IN_CLOSE_NOWRITE
_IN_OPEN = 0x00000020
_IN_GONE = 0x00000200 | 0x00000040  # IN_DELETE | IN_MOVED_FROM
_IN_OVERFLOW = 0x00004000  # IN_Q_OVERFLOW: events were lost
_IN_CHANGES = _IN_CLOSE | _IN_OPEN | _IN_GONE | 0x00000100 | 0x00000080  # IN_CREATE, IN_MOVED_TO


class _Odd(Exception):
    """The object at a flag's name is not one the daemon follows (see the module docstring)."""


class _Unsized(Exception):
    """The engine's segment has no size yet: it is being created (``SharedMemory`` sizes it right after)."""


class _Segment:
    """One flag array's name: the segment it names now (its descriptor kept open), and a mapping of each
    of the last ``MAX_FOLLOWED`` segments it has named."""

    def __init__(self, name: str, hidden: str, ranks: int, access: Access, trusted: frozenset[int]) -> None:
        self.name = name  # e.g. "cache_ready_signal.8021"
        self.path = SHM_DIR / name
        self.hidden = SHM_DIR / hidden  # our second name of the current segment (a hard link)
        self.ranks = ranks
        self.size = 4 * ranks
        self.access = access
        self.trusted = trusted
        self.views: OrderedDict[int, tuple[mmap.mmap, np.ndarray[Any, Any]]] = OrderedDict()  # inode -> view
        self.fd = -1  # the current segment, open
        self.current = -1  # inode the public name had when we last looked
        self.created: set[int] = set()  # inodes this run created
        self.values = [0] * ranks
        self.missing_since: float | None = None  # when the public name was first seen gone
        self.grace = RELINK_GRACE_S  # how long it is left gone before it is linked back
        self.opened_at: float | None = None  # when an open was the name's last event (inotify), if it is
        self.followed_at = 0.0  # when the current segment was first followed
        self.refused: int | None = None  # inode of the odd object at the name: not looked at again
        self.said = ""  # the last warning, not repeated
        self.warnings: list[str] = []

    def open(self, *, create: bool = True) -> bool:
        """Follow what the name holds now, or create it (unless not ``create``: then False when the name is
        gone). Raises ``SignalError`` for an engine's segment of another size, ``_Odd`` for an object that
        is not a segment the daemon follows, ``_Unsized`` for one being created.

        The daemon never opens (nor closes) the public name itself: ``tick`` reads the engine's habits from
        the opens and closes of that name. A segment is looked at through an ``O_PATH`` handle and opened
        through a link of its own (the temporary name, then the hidden one); one the daemon makes is made
        under the temporary name, sized, and linked to the public name whole. The temporary name is new at
        every call and nobody can guess it: another user who made it first (/dev/shm is everyone's) would
        keep the daemon from following any segment."""
        temporary = self.hidden.with_name(f"{self.hidden.name}.new.{secrets.token_hex(8)}")
        created = False
        fd = self._open_existing(temporary)
        if fd < 0:
            if not create:
                return False
            fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.ftruncate(fd, self.size)
                self.access.apply(fd)
                os.link(temporary, self.path)
                created = True
            except FileExistsError:  # the engine created it just now: follow that one
                os.close(fd)
                temporary.unlink(missing_ok=True)
                fd = self._open_existing(temporary)
                if fd < 0:
                    return False
            except OSError:  # /dev/shm full: nothing of ours is left at either name
                os.close(fd)
                temporary.unlink(missing_ok=True)
                raise
        try:
            st = os.fstat(fd)
            self._check(st)
            self._map(fd, st.st_ino)
            try:
                os.replace(temporary, self.hidden)
            except (PermissionError, IsADirectoryError):
                raise SignalError(
                    f"{self.hidden} belongs to another user: remove it, or pick another --instance"
                ) from None
        except BaseException:
            os.close(fd)
            temporary.unlink(missing_ok=True)
            raise
        if created:
            self.created.add(st.st_ino)
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.current, self.refused, self.said = fd, st.st_ino, None, ""
        self.followed_at = time.monotonic()
        self.write()
        return True

    def _open_existing(self, temporary: Path) -> int:
        """A descriptor of the segment at the name, opened through ``temporary`` (linked to it), or -1 when
        the name holds nothing. Raises ``_Odd`` for an object the daemon does not follow (a directory, a
        symlink, another user's), ``_Unsized`` and ``SignalError`` as ``_check`` does."""
        try:
            handle = os.open(self.path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return -1
        try:
            st = os.fstat(handle)
            self._check(st)
            try:
                _link(handle, temporary)
            except FileNotFoundError:  # it lost its name meanwhile
                return -1
        finally:
            os.close(handle)
        try:
            fd = os.open(temporary, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            raise _Odd(f"{self.path} cannot be opened by the daemon's user: {exc.strerror}") from None
        return fd

    def _check(self, st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            raise _Odd(f"{self.path} is not a shared-memory segment ({_kind(st.st_mode)})")
        if st.st_uid not in self.trusted:
            trusted = ", ".join(map(str, sorted(self.trusted)))
            raise _Odd(
                f"{self.path} belongs to uid {st.st_uid}, not to a user the daemon trusts (uids {trusted}; "
                "--engine-user names the engine's)"
            )
        if st.st_mode & stat.S_IWOTH:
            raise _Odd(f"{self.path} is writable by anyone (mode {stat.S_IMODE(st.st_mode):o}): not the engine's")
        if st.st_size == 0:
            raise _Unsized()
        if st.st_size != self.size:
            raise SignalError(
                f"{self.path} has {st.st_size} bytes; {self.ranks} ranks need {self.size} (int32 per rank): "
                "does --ranks match the engine's tensor-parallel size?"
            )

    def _map(self, fd: int, inode: int) -> None:
        """Map segment ``inode`` (at most ``MAX_FOLLOWED`` are kept: the oldest goes)."""
        if inode in self.views:
            self.views.move_to_end(inode)
            return
        mapping = mmap.mmap(fd, self.size)
        self.views[inode] = (mapping, np.frombuffer(mapping, dtype=np.int32, count=self.ranks))
        while len(self.views) > MAX_FOLLOWED:
            _, (old, values) = self.views.popitem(last=False)
            del values
            with contextlib.suppress(BufferError):
                old.close()

    def follow(self, *, now: bool = False) -> None:
        """Keep the name right: back as our segment once it has been gone its grace (``gone``; at once with
        ``now``), followed if it names another one the daemon trusts; an odd object there is said once
        (``warnings``) and left alone."""
        try:
            self._follow(now)
        except _Unsized:
            pass  # looked at again next time
        except (_Odd, SignalError, OSError, ValueError) as exc:
            if isinstance(exc, _Odd):
                self.refused = _inode(self.path)
            self.warn(f"{exc}; left alone, the flags are kept in the segments already followed")

    def warn(self, warning: str) -> None:
        if warning != self.said:
            self.said = warning
            self.warnings.append(warning)

    def _follow(self, now: bool) -> None:
        inode = _inode(self.path)
        if inode != -1:
            self.missing_since = None
        if inode != -1 and inode in (self.current, self.refused):
            return
        if inode == -1:
            seen = time.monotonic()
            if self.missing_since is None:
                self.gone(seen)
            assert self.missing_since is not None
            if not now and seen - self.missing_since < self.grace:
                return
            self.missing_since = None
            try:
                _link(self.fd, self.path)  # the same segment, under its public name again
                return
            except FileExistsError:  # created meanwhile: follow it below
                pass
            except (FileNotFoundError, OSError):
                pass  # no segment held (never opened), or it lost every name: make it anew
            self.open()
        elif not self.open(create=False):  # another segment, gone again already: wait for the next
            self.gone(time.monotonic())

    def gone(self, seen: float) -> None:
        """The name went away at ``seen``: the engine's unlink-and-create (an open just before) gets
        ``ENGINE_GRACE_S``, anything else ``RELINK_GRACE_S``. The event of a deletion ``follow`` saw first
        keeps the engine's grace (its open was taken into account then)."""
        engine = self.opened_at is not None and seen - self.opened_at <= ENGINE_WINDOW_S
        engine = engine or (self.missing_since is not None and self.grace == ENGINE_GRACE_S)
        self.missing_since, self.grace, self.opened_at = seen, ENGINE_GRACE_S if engine else RELINK_GRACE_S, None

    def due(self) -> float | None:
        """Seconds until a name that went away is linked back, or the values of a segment followed just
        now are written again; None when neither is pending."""
        now = time.monotonic()
        settling = SETTLE_EVERY_S if now - self.followed_at < SETTLE_S else None
        if self.missing_since is None:
            return settling
        relink = max(0.0, self.missing_since + self.grace - now)
        return relink if settling is None else min(relink, settling)

    def write(self) -> None:
        for _, values in self.views.values():
            for rank, value in enumerate(self.values):
                if values[rank] != value:
                    values[rank] = value

    def close(self) -> None:
        """0 everywhere; unlink the name only if this run created what it names; drop the hidden name."""
        self.values = [0] * self.ranks
        self.follow(now=True)
        self.write()
        self.warnings.clear()
        if _inode(self.path) in self.created:
            self.path.unlink(missing_ok=True)
        for leftover in (self.hidden, *SHM_DIR.glob(glob.escape(self.hidden.name) + ".new.*")):
            with contextlib.suppress(FileNotFoundError, PermissionError, IsADirectoryError):  # another user's
                leftover.unlink()
        for mapping, _ in self.views.values():
            with contextlib.suppress(BufferError):
                mapping.close()
        self.views.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _link(fd: int, path: Path) -> None:
    """Give the file open at ``fd`` the name ``path`` (``linkat`` of ``/proc/self/fd/<fd>``, following it:
    the very file that was checked, whatever its names say by now). ``FileNotFoundError`` when it has no
    name left, or ``fd`` is not open."""
    if fd < 0:
        raise FileNotFoundError(f"no segment to link to {path}")
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.link(f"/proc/self/fd/{fd}", path.name, dst_dir_fd=directory, follow_symlinks=True)
    finally:
        os.close(directory)


def _inode(path: Path) -> int:
    """The inode at ``path`` (not following a symlink), or -1."""
    try:
        return os.lstat(path).st_ino
    except FileNotFoundError:
        return -1


def _kind(mode: int) -> str:
    kinds = {stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symlink", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}
    return kinds.get(stat.S_IFMT(mode), "not a plain file")


class ReadyFlags:
    """The two flag arrays of one instance. Methods raise ``SignalError`` with a clear message.
    ``fileno()`` is an inotify descriptor on /dev/shm, readable when a name there changed (-1 without
    inotify: then only the supervisor's tick keeps the names right)."""

    def __init__(self, instance: str, suffix: int, ranks: int, access: Access, engine_uid: int | None = None) -> None:
        check_instance(instance)
        trusted = frozenset({os.geteuid(), 0, *([engine_uid] if engine_uid is not None else [])})
        self.segments = [
            _Segment(f"{name}.{suffix}", f"{PREFIX}.{instance}.fd.{name}.{suffix}", ranks, access, trusted)
            for name in SIGNALS
        ]
        self.ranks = ranks
        self.inotify = _inotify(SHM_DIR)

    def fileno(self) -> int:
        return self.inotify

    def open(self) -> None:
        """Attach or create both, and write 0 for every rank. Raises ``SignalError`` for an engine's
        segment of another size; an odd object at a name is a warning (``take_warnings``): the flag is
        kept from when the name is free."""
        for segment in self.segments:
            try:
                segment.open()
            except _Odd as exc:
                segment.refused = _inode(segment.path)
                segment.warn(f"{exc}; left alone: the flag is published once the name is free")
            except _Unsized:
                pass  # the engine is creating it: followed at the next tick

    def take_warnings(self) -> list[str]:
        """What was refused since the last call, each once."""
        found = [warning for segment in self.segments for warning in segment.warnings]
        for segment in self.segments:
            segment.warnings.clear()
        return found

    def update(self, ready: list[bool], has_pool: bool) -> None:
        """New values: ``ready[r]`` is rank r's cache present in this generation."""
        cache, swap = self.segments
        cache.values = [int(flag) for flag in ready]
        swap.values = [int(flag and has_pool) for flag in ready]
        for segment in self.segments:
            segment.write()

    def due(self) -> float | None:
        """Seconds until ``tick`` must run again to link a name back; None when nothing is pending."""
        pending = [d for d in (segment.due() for segment in self.segments) if d is not None]
        return min(pending) if pending else None

    def tick(self) -> None:
        """Read what inotify reports (if anything), in order, and keep every name right. A name deleted
        again restarts its grace: the engine may be re-creating it over and over."""
        by_name = {segment.name.encode(): segment for segment in self.segments}
        if self.inotify >= 0:
            with contextlib.suppress(BlockingIOError, InterruptedError):
                while data := os.read(self.inotify, 64 * 1024):
                    now = time.monotonic()
                    for mask, name in _events(data):
                        if mask & _IN_OVERFLOW:  # what went on is lost: the engine's grace, to be safe
                            for each in self.segments:
                                each.opened_at = now
                        elif (named := by_name.get(name)) is not None:
                            if mask & _IN_GONE:
                                named.gone(now)
                            elif mask & (_IN_OPEN | _IN_CLOSE):
                                named.opened_at = now if mask & _IN_OPEN else None
        now = time.monotonic()
        for segment in self.segments:
            segment.follow()
            if now - segment.followed_at < SETTLE_S:  # the engine's initial values may have landed over ours
                segment.write()

    def close(self) -> None:
        for segment in self.segments:
            segment.close()
        if self.inotify >= 0:
            with contextlib.suppress(OSError):
                os.close(self.inotify)
            self.inotify = -1


_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then len bytes of name


def _events(data: bytes) -> Iterator[tuple[int, bytes]]:
    """The inotify events in ``data``, in order: (mask, the name they are about, b"" for none); a name is
    not decoded (every open and close in /dev/shm comes through here)."""
    offset = 0
    while offset + _EVENT.size <= len(data):
        _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
        offset += _EVENT.size
        yield mask, data[offset : offset + length].split(b"\0", 1)[0]
        offset += length


def _inotify(directory: Path) -> int:
    """An inotify descriptor watching names come and go in ``directory``, or -1 where there is none."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = int(libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))
    if fd >= 0 and libc.inotify_add_watch(fd, str(directory).encode(), _IN_CHANGES) < 0:
        os.close(fd)
        fd = -1
    return fd
