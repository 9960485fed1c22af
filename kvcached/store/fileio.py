"""The file store's object I/O: loads with several objects in flight, each read straight into its target block and
verified in the same pass, and stores written in one pass and made durable in groups while the next are written.

Loads (``Reader``)::

    thread t (of up to READ_THREADS, each with a READ_CHUNK-byte buffer that stays in its core's cache), in one native
    call for up to PROGRESS_OBJECTS objects (``kvcached/_verify.c``, ``kv_read_objects``):
      take the next index i -> open, fstat, read the header
      -> read the payload a READ_CHUNK-byte request at a time into the buffer, and land each request from there in
         target i's pieces, hashed on the way
      -> an object not read whole, or whose header does not name its key and checksum, stops the taking past i
      -> take again
    the count reported: the leading indices that all verified (``Reader``); the first that did not is judged again in
    Python, to say why. Each object read whole has its file's times set to now as it is read (the least recently used
    order a restart rebuilds; one whose times cannot be set is served all the same), and put back as they were for any
    read past the first that failed (not reported: not used). A load cut short (its agent killed at a timeout) leaves
    the times of what it read set.

Stores (``Writer``)::

    caller:    per object: a temporary file <- the payload in CHUNK-byte writes, each hashed just before it is written
               (from the caller's pieces: no gather), the header last; writeback started (``sync_file_range``); queued
    committer: takes everything queued -> fsync each -> rename each: the group's durability point (a group is what
               was written while the last one was made durable)

A crash at any point leaves whole objects under their names and temporaries, which the next start removes."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import itertools
import mmap
import os
import queue
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kvcached import native
from kvcached.store.base import HEADER, HEADER_SIZE, ObjectIdentity, header_checksum
from kvcached.store.landing import Targets, read_into

#: Bytes per write request, each hashed just before it is written.
CHUNK = 1 << 20
#: Bytes per read request, landed and hashed as soon as it arrives, while in the core's cache (a 1 MiB L2 holds it;
#: a 512 KiB object is one request: 6-10 % less CPU than 128 KiB requests, docs/benchmarks.md).
READ_CHUNK = 512 << 10
#: Objects read at once by one load (several requests in flight to the disk; both cores on a warm load).
READ_THREADS = 4
#: Objects a reader thread reads in one native call (their progress told after it), and the time after which it returns
#: sooner (a slow disk's loads tell their progress object by object: the store's timeout is one without progress).
PROGRESS_OBJECTS = 4
PROGRESS_S = 0.02
#: Why a read found no object at all (a miss, not a corrupt object).
MISSING = "missing"

READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # a FIFO in an object's place never blocks
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)  # None: not Linux
if _sync_file_range is not None:
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


#: What reading an object gave: (payload bytes read, or -errno, ``native.NOT_REGULAR`` or ``native.WRONG_SIZE``;
#: the header bytes read, or the file's size for ``WRONG_SIZE``; the header; the payload's XXH3-64 if whole).
Read = tuple[int, int, bytes | bytearray, int | None]


def verdict(identity: ObjectIdentity, key: bytes, read: Read) -> str | None:
    """What reading ``key``'s object gave (``Read``), judged: None if whole, else why not (``MISSING``: no file). The
    header is checked after the payload has landed (a target past the verified prefix may hold anything)."""
    size = HEADER_SIZE + identity.payload
    got, found, head, digest = read
    if got == -errno.ENOENT:
        return MISSING
    if got == native.NOT_REGULAR:
        return "not a regular file"
    if got == native.WRONG_SIZE:
        return f"{found} bytes, an object has {size}"
    if got < 0:
        return f"unreadable: {os.strerror(-got)}"
    why = identity.verify_header(key, memoryview(head)[:found], size)
    if why is not None:
        return why
    if digest is None:
        return f"truncated: {got} of {identity.payload} payload bytes"
    return None if digest == header_checksum(bytes(head)) else "checksum mismatch"


def read_object(
    path: str | Path, size: int, targets: Targets, i: int, bounce: memoryview
) -> tuple[Read, tuple[int, int] | None]:
    """Read the ``size``-byte object at ``path``, its payload into target ``i`` (through ``bounce``), in Python
    (``kv_read_objects``'s way without the native routines): what reading it gave and, if it was read whole, the access
    and modification times (ns) it had before they were set to now (None: left as they were)."""
    try:
        fd = os.open(path, READ_FLAGS)
    except OSError as exc:
        return (-(exc.errno or errno.EIO), 0, b"", None), None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return (native.NOT_REGULAR, 0, b"", None), None
        if st.st_size != size:
            return (native.WRONG_SIZE, st.st_size, b"", None), None
        head = os.pread(fd, HEADER_SIZE, 0)
        if len(head) < HEADER_SIZE:
            return (0, len(head), head, None), None
        done, digest = read_into(fd, HEADER_SIZE, targets, i, bounce)
        if digest is None:
            return (done, len(head), head, digest), None
        try:
            os.utime(fd)
        except OSError:  # a read-only disk, another user's file: served all the same, its times as they were
            return (done, len(head), head, digest), None
        return (done, len(head), head, digest), (st.st_atime_ns, st.st_mtime_ns)
    except OSError as exc:
        return (-(exc.errno or errno.EIO), 0, b"", None), None
    finally:
        os.close(fd)


@dataclasses.dataclass(slots=True)
class Outcome:
    """What a load did: ``landed`` leading objects verified; ``why`` the next one did not (None: every one landed)."""

    landed: int
    why: str | None = None


class _ReadsInPython:
    """``native.ObjectReads`` without the native routines: ``keys[i]``'s object at ``paths[i]`` into target ``i``."""

    def __init__(
        self, identity: ObjectIdentity, keys: Sequence[bytes], paths: Sequence[str | Path], targets: Targets
    ) -> None:
        self.identity, self.keys, self.paths, self.targets = identity, keys, paths, targets
        self.size = HEADER_SIZE + identity.payload
        self.reads: list[Read] = [(0, 0, b"", None)] * len(paths)
        self.times: list[tuple[int, int] | None] = [None] * len(paths)
        self.next = itertools.count()  # taken under the interpreter's lock: each index once
        self.stop = len(paths)
        self.lock = threading.Lock()

    def take(self, bounce: memoryview, limit: int, budget_s: float) -> int:
        taken, until = 0, time.monotonic() + budget_s
        while taken < limit and (i := next(self.next)) < len(self.paths) and i <= self.stop:
            self.reads[i], self.times[i] = read_object(self.paths[i], self.size, self.targets, i, bounce)
            if verdict(self.identity, self.keys[i], self.reads[i]) is not None:
                with self.lock:
                    self.stop = min(self.stop, i)
            taken += 1
            if time.monotonic() >= until:
                break
        return taken

    def read(self, i: int) -> Read:
        return self.reads[i]

    def before(self, i: int) -> tuple[int, int] | None:
        return self.times[i]


class Reader:
    """Loads objects with up to ``READ_THREADS`` in flight, each straight into its target (see the module). Its objects
    carry no tag (``identity`` has no secret, as the file store's), so the native checks are the whole verdict."""

    def __init__(self, identity: ObjectIdentity) -> None:
        assert identity.secret is None, "a tagged object's verdict is more than kv_read_objects checks"
        self.identity = identity
        self._expect = identity.header(bytes(32), 0)[: HEADER.size]
        # A queue a thread, not an executor: handing a load to four threads and back costs 60 us, not 160.
        self._work: list[queue.SimpleQueue[Callable[[memoryview], None] | None]] = []
        self._done: queue.SimpleQueue[BaseException | None] = queue.SimpleQueue()
        self._threads = []
        for n in range(READ_THREADS):
            self._work.append(queue.SimpleQueue())
            self._threads.append(
                threading.Thread(target=self._serve, args=(n,), name=f"kvcached-read-{n}", daemon=True)
            )
            self._threads[-1].start()
        started = [self._done.get() for _ in self._threads]  # every thread up, its buffer mapped, before a load
        if (error := next(filter(None, started), None)) is not None:
            self.close()
            raise error

    def _serve(self, n: int) -> None:
        """Reader thread ``n``: map its request buffer (page-aligned, populated), then run its jobs until None."""
        try:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
            bounce = memoryview(mmap.mmap(-1, READ_CHUNK, flags=flags))
        except BaseException as exc:
            self._done.put(exc)
            return
        self._done.put(None)
        while (job := self._work[n].get()) is not None:
            try:
                job(bounce)
            except BaseException as exc:
                self._done.put(exc)
            else:
                self._done.put(None)

    def load(
        self, keys: Sequence[bytes], paths: Sequence[str | Path], targets: Targets, on_progress: Callable[[], None]
    ) -> Outcome:
        """Read ``keys``'s objects at ``paths`` into ``targets``; the leading ones that all verified."""
        if not keys:
            return Outcome(0)
        size = HEADER_SIZE + self.identity.payload
        reads: native.ObjectReads | _ReadsInPython
        if native.hashes(self.identity.payload):
            ids = np.asarray(targets.ids, dtype=np.int64)
            files = [os.fsencode(path) for path in paths]
            keyed = b"".join(keys)
            reads = native.ObjectReads(
                files, size=size, header_len=HEADER_SIZE, expect=self._expect, keys=keyed, side=targets.side, ids=ids
            )
        else:
            reads = _ReadsInPython(self.identity, keys, paths, targets)

        def run(bounce: memoryview) -> None:
            while taken := reads.take(bounce, PROGRESS_OBJECTS, PROGRESS_S):
                for _ in range(taken):
                    on_progress()

        for work in self._work[: min(READ_THREADS, len(keys))]:
            work.put(run)
        errors = [self._done.get() for _ in range(min(READ_THREADS, len(keys)))]  # every thread done first
        if (error := next(filter(None, errors), None)) is not None:
            raise error
        landed = min(reads.stop, len(keys))  # every object below ``stop`` read whole and verified
        if landed == len(keys):
            return Outcome(landed)
        reported = set(paths[:landed])  # (a key asked for twice: its reported copy's times stay)
        for i in range(landed + 1, len(keys)):  # read whole but not reported: not used, its times as they were
            if (before := reads.before(i)) is not None and paths[i] not in reported:
                with contextlib.suppress(OSError):
                    os.utime(paths[i], ns=before, follow_symlinks=False)
        return Outcome(landed, verdict(self.identity, keys[landed], reads.read(landed)) or "header mismatch")

    def close(self) -> None:
        for work in self._work:
            work.put(None)
        for thread in self._threads:
            thread.join()


def _chunks(pieces: Sequence[memoryview], size: int) -> Iterator[list[memoryview]]:
    """``pieces`` cut and grouped into runs of at most ``size`` bytes, in order."""
    run: list[memoryview] = []
    room = size
    for piece in pieces:
        rest = piece.cast("B") if piece.format != "B" or piece.ndim != 1 else piece
        while len(rest):
            part, rest = rest[:room], rest[room:]
            run.append(part)
            room -= len(part)
            if room == 0:
                yield run
                run, room = [], size
    if run:
        yield run


def _pwrite_all(fd: int, views: list[memoryview], offset: int) -> int:
    """Write every byte of ``views`` at ``offset``; the offset after them."""
    while views:
        done = os.pwritev(fd, views, offset)
        offset += done
        while views and done >= len(views[0]):
            done -= len(views[0])
            views = views[1:]
        if views and done:
            views = [views[0][done:], *views[1:]]
    return offset


def write_temporary(identity: ObjectIdentity, tmp: Path, key: bytes, pieces: Sequence[memoryview]) -> int:
    """Write ``key``'s object (record: ``pieces`` joined) to the new file ``tmp``, start its writeback; its open fd."""
    if sum(len(piece) for piece in pieces) != identity.payload:
        raise ValueError(f"a block record has {identity.payload} bytes, not {sum(len(p) for p in pieces)}")
    try:
        fd = os.open(tmp, _WRITE, 0o600)
    except OSError as exc:
        raise _failed(exc, f"cannot write store object {tmp}") from None
    try:
        digest = xxhash.xxh3_64()
        offset = HEADER_SIZE
        for run in _chunks(pieces, CHUNK):
            for part in run:
                digest.update(part)
            offset = _pwrite_all(fd, run, offset)
        _pwrite_all(fd, [memoryview(identity.header(key, digest.intdigest()))], 0)
        if _sync_file_range is not None:
            _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
    except BaseException as exc:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _failed(exc, f"cannot write store object {tmp}") from None
        raise
    return fd


def _failed(exc: OSError, what: str) -> OSError:
    """``exc`` (same class and errno: a full disk stays ENOSPC) saying what failed on which path."""
    return type(exc)(exc.errno, f"{exc.strerror or os.strerror(exc.errno or 0)}: {what}")


@dataclasses.dataclass(slots=True)
class Pending:
    """A written object waiting for its group's durability point."""

    key: bytes
    tmp: Path
    path: Path
    fd: int


class Writer:
    """One store call's objects: written by the caller (``add`` each), made durable and renamed in groups by a committer
    thread; ``finish`` waits for the last group. A failed group ends the call: its temporaries and those queued after it
    are removed, and ``add`` raises what failed."""

    def __init__(self, on_progress: Callable[[], None]) -> None:
        self.on_progress = on_progress
        self.cond = threading.Condition()
        self.queue: list[Pending] = []
        self.committed: list[bytes] = []
        self.error: BaseException | None = None
        self.closed = False
        self.thread = threading.Thread(target=self._commit_loop, name="kvcached-commit", daemon=True)
        self.thread.start()

    def add(self, pending: Pending) -> None:
        with self.cond:
            if self.error is not None:
                _discard([pending])
                raise self.error
            self.queue.append(pending)
            self.cond.notify_all()

    def finish(self) -> list[bytes]:
        """Wait until everything added is durable (or dropped after a failure); the keys now stored."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.thread.join()
        return self.committed

    def _commit_loop(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.closed:
                    self.cond.wait()
                group, self.queue = self.queue, []
                if not group:
                    return
                if self.error is not None:
                    _discard(group)
                    continue
            try:
                for pending in group:
                    try:
                        os.fsync(pending.fd)
                    except OSError as exc:
                        raise _failed(exc, f"cannot make store object {pending.tmp} durable (fsync)") from None
                for pending in group:
                    os.close(pending.fd)
                    pending.fd = -1
                    if os.path.isdir(pending.path) and not os.path.islink(pending.path):
                        shutil.rmtree(pending.path, ignore_errors=True)  # something took the name: ours again
                    os.rename(pending.tmp, pending.path)
                    with self.cond:
                        self.committed.append(pending.key)
            except BaseException as exc:
                with self.cond:
                    self.error = exc
                _discard([p for p in group if p.fd >= 0 or p.tmp.exists()])
            self.on_progress()


def _discard(pendings: list[Pending]) -> None:
    for pending in pendings:
        if pending.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(pending.fd)
            pending.fd = -1
        with contextlib.suppress(OSError):
            os.unlink(pending.tmp)
