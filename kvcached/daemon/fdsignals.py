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
  supervisor keeps a mapping of every segment it has held under a name and writes each value into all of
  them.
* **A name taken away comes back at once, as the same segment.** Every FastDeploy reader that attaches
  with ``IPCSignal(create=False)`` and exits unlinks the name (Python's resource tracker registers every
  ``SharedMemory`` it opens). The supervisor holds a second name of the current segment (a hard link,
  ``/dev/shm/kvcached.<instance>.fd.<name>``), watches /dev/shm with inotify, and links the public name
  back to the same segment ``RELINK_GRACE_S`` after it went (the engine re-creating the segment unlinks
  the name and creates it at once: it must find the name free): every waiter mapped to it, and every
  reader that opens the name next, see the same memory with the current values. (A reader that opens
  the name within those milliseconds of another's exit finds it gone, as it would without kvcached;
  a process starting after another's exit takes longer than that.)
* **What the engine created is the engine's.** At stop every entry becomes 0 in every mapping; a name
  is unlinked only if this run created the segment it names now; the hidden links are removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np
import posix_ipc

from kvcached.access import Access
from kvcached.protocol.errors import SignalError
from kvcached.protocol.names import PREFIX, SHM_DIR, check_instance

SIGNALS = ("cache_ready_signal", "swap_space_ready_signal")
#: A name gone for this long is linked back (sooner, and the engine's IPCSignal(create=True), which
#: unlinks the name and then creates it exclusively, could find our link there and fail).
RELINK_GRACE_S = 0.02

_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
_IN_CHANGES = 0x00000100 | 0x00000200 | 0x00000040 | 0x00000080  # IN_CREATE | IN_DELETE | IN_MOVED_FROM/TO


class _Segment:
    """One flag array's name: the segment it names now, and a mapping of every segment it has named."""

    def __init__(self, name: str, hidden: str, ranks: int, access: Access) -> None:
        self.name = name  # e.g. "cache_ready_signal.8021"
        self.path = SHM_DIR / name
        self.hidden = SHM_DIR / hidden  # our second name of the current segment (a hard link)
        self.ranks = ranks
        self.access = access
        self.views: dict[int, tuple[mmap.mmap, np.ndarray[Any, Any]]] = {}  # inode -> mapping, values
        self.current = -1  # inode the public name had when we last looked
        self.created: set[int] = set()  # inodes this run created
        self.values = [0] * ranks
        self.missing_since: float | None = None  # when the public name was first seen gone

    def open(self, *, create: bool = True) -> bool:
        """Attach to what the name holds now, or create it (unless not ``create``: then False when the
        name is gone); raise ``SignalError`` for a segment too small or not ours to write."""
        posix = f"/{self.name}"
        size = 4 * self.ranks
        try:
            shm = posix_ipc.SharedMemory(posix)
            created = False
        except posix_ipc.ExistentialError:
            if not create:
                return False
            try:
                shm = posix_ipc.SharedMemory(posix, posix_ipc.O_CREX, mode=0o600, size=size)
            except posix_ipc.ExistentialError:  # the engine created it just now
                shm = posix_ipc.SharedMemory(posix)
                created = False
            else:
                self.access.apply(shm.fd)
                created = True
        except posix_ipc.PermissionsError:
            raise SignalError(f"{self.path} exists and is not writable by the daemon's user") from None
        try:
            st = os.fstat(shm.fd)
            if st.st_size < size:
                raise SignalError(
                    f"{self.path} has {st.st_size} bytes; {self.ranks} ranks need {size} (int32 per rank): "
                    "does --ranks match the engine's tensor-parallel size?"
                )
            if st.st_ino not in self.views:
                mapping = mmap.mmap(shm.fd, size)
                self.views[st.st_ino] = (mapping, np.frombuffer(mapping, dtype=np.int32, count=self.ranks))
        finally:
            shm.close_fd()
        if created:
            self.created.add(st.st_ino)
        self.current = st.st_ino
        self._hide()
        self.write()
        return True

    def _hide(self) -> None:
        """Point the hidden name at the current segment (link to a temporary name, rename over)."""
        temporary = self.hidden.with_name(self.hidden.name + ".new")
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        try:
            os.link(self.path, temporary)
            os.replace(temporary, self.hidden)
        except FileNotFoundError:
            pass  # the name went away meanwhile: follow() links it back from what we hold

    def follow(self, *, now: bool = False) -> None:
        """Keep the name right: back as our segment if it has been gone ``RELINK_GRACE_S`` (at once with
        ``now``), followed if it names another one."""
        try:
            inode = os.stat(self.path).st_ino
        except FileNotFoundError:
            inode = -1
        if inode != -1:
            self.missing_since = None
        if inode == self.current:
            return
        if inode == -1:
            seen = time.monotonic()
            self.missing_since = self.missing_since or seen
            if not now and seen - self.missing_since < RELINK_GRACE_S:
                return
            self.missing_since = None
            try:
                os.link(self.hidden, self.path)  # the same segment, under its public name again
                return
            except FileExistsError:  # created meanwhile: follow it below
                pass
            except FileNotFoundError:
                pass  # no hidden name (never linked): make the segment anew
            self.open()
        elif not self.open(create=False):  # another segment, gone again already: wait for the next
            self.missing_since = time.monotonic()

    def due(self) -> float | None:
        """Seconds until a name that went away is linked back; None when none is pending."""
        if self.missing_since is None:
            return None
        return max(0.0, self.missing_since + RELINK_GRACE_S - time.monotonic())

    def write(self) -> None:
        for _, values in self.views.values():
            for rank, value in enumerate(self.values):
                if values[rank] != value:
                    values[rank] = value

    def close(self) -> None:
        """0 everywhere; unlink the name only if this run created what it names; drop the hidden name."""
        self.values = [0] * self.ranks
        with contextlib.suppress(OSError):
            self.follow(now=True)
        self.write()
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino in self.created:
                self.path.unlink()
        for leftover in (self.hidden, self.hidden.with_name(self.hidden.name + ".new")):
            leftover.unlink(missing_ok=True)
        for mapping, _ in self.views.values():
            with contextlib.suppress(BufferError):
                mapping.close()
        self.views.clear()


class FastDeploySignals:
    """The two flag arrays of one instance. Methods raise ``SignalError`` with a clear message.
    ``fileno()`` is an inotify descriptor on /dev/shm, readable when a name there changed (-1 without
    inotify: then only the supervisor's tick keeps the names right)."""

    def __init__(self, instance: str, suffix: int, ranks: int, access: Access) -> None:
        check_instance(instance)
        self.segments = [
            _Segment(f"{name}.{suffix}", f"{PREFIX}.{instance}.fd.{name}.{suffix}", ranks, access) for name in SIGNALS
        ]
        self.ranks = ranks
        self.inotify = _inotify(SHM_DIR)

    def fileno(self) -> int:
        return self.inotify

    def open(self) -> None:
        """Attach or create both, and write 0 for every rank."""
        for segment in self.segments:
            segment.open()

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
        """Read what inotify reports (if anything), and keep every name right. A name deleted again
        restarts its grace: the engine may be re-creating it over and over."""
        deleted: set[str] = set()
        if self.inotify >= 0:
            with contextlib.suppress(BlockingIOError, InterruptedError):
                while data := os.read(self.inotify, 64 * 1024):
                    deleted |= _deleted_names(data)
        now = time.monotonic()
        for segment in self.segments:
            if segment.name in deleted:
                segment.missing_since = now
            segment.follow()

    def close(self) -> None:
        for segment in self.segments:
            segment.close()
        if self.inotify >= 0:
            with contextlib.suppress(OSError):
                os.close(self.inotify)
            self.inotify = -1


_IN_DELETE_OR_MOVED_FROM = 0x00000200 | 0x00000040
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then len bytes of name


def _deleted_names(data: bytes) -> set[str]:
    """Names that inotify events in ``data`` report deleted (or moved away)."""
    names, offset = set(), 0
    while offset + _EVENT.size <= len(data):
        _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
        offset += _EVENT.size
        if mask & _IN_DELETE_OR_MOVED_FROM:
            names.add(data[offset : offset + length].split(b"\0", 1)[0].decode(errors="replace"))
        offset += length
    return names


def _inotify(directory: Path) -> int:
    """An inotify descriptor watching names come and go in ``directory``, or -1 where there is none."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = int(libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))
    if fd >= 0 and libc.inotify_add_watch(fd, str(directory).encode(), _IN_CHANGES) < 0:
        os.close(fd)
        fd = -1
    return fd
