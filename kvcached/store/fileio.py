"""The file store's object I/O: loads with several reads in flight, each object verified before a byte
of it lands, and stores written in one pass and made durable in groups while the next objects are written.

Loads (``Reader``)::

    thread t (of up to READ_THREADS, each with a buffer of one payload):
      pick the next index i -> open, fstat, read and check the header
      -> read the payload in CHUNK-byte requests, hashing each chunk as soon as it is read (still in cache)
      -> checksum holds? wait until every index below i is verified -> land i (the sink) -> pick again
    a failure at i: no index after i lands; threads holding one drop it

Stores (``Writer``)::

    caller:    per object: a temporary file <- the payload in CHUNK-byte writes, each chunk hashed just
               before it is written (from the caller's pieces: no gather), the header last; writeback
               started (``sync_file_range``); queued
    committer: takes everything queued -> fsync each -> rename each: the group's durability point
               (a group is what was written while the last one was made durable)

A crash at any point leaves whole objects under their names and temporaries, which the next start removes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import mmap
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import xxhash

from kvcached.protocol.layout import round_up
from kvcached.store.base import HEADER_SIZE, ObjectIdentity, Sink, header_checksum

#: Bytes per read or write request, each hashed while it is in the CPU's cache.
CHUNK = 1 << 20
#: Objects read at once by one load (several requests in flight to the disk; both cores on a warm load).
READ_THREADS = 4
#: Memory for the readers' buffers (one payload each): fewer threads for very large blocks.
READ_BUFFER_BYTES = 64 << 20
#: Why a read found no object at all (a miss, not a corrupt object).
MISSING = "missing"

READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # a FIFO in an object's place never blocks
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)  # None: not Linux
if _sync_file_range is not None:
    _sync_file_range.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)


def read_object(identity: ObjectIdentity, key: bytes, path: Path, into: memoryview) -> str | None:
    """Read and verify ``key``'s object at ``path``, its payload into ``into``; None if it is whole, else
    why not (``MISSING`` when there is no file)."""
    try:
        fd = os.open(path, READ_FLAGS)
    except FileNotFoundError:
        return MISSING
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    try:
        st = os.fstat(fd)
        size = HEADER_SIZE + identity.payload
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if st.st_size != size:
            return f"{st.st_size} bytes, an object has {size}"
        head = os.pread(fd, HEADER_SIZE, 0)
        why = identity.verify_header(key, memoryview(head), st.st_size)
        if why is not None:
            return why
        digest = xxhash.xxh3_64()
        done = 0
        while done < identity.payload:
            got = os.preadv(fd, [into[done : done + CHUNK]], HEADER_SIZE + done)
            if got <= 0:
                return f"truncated: {done} of {identity.payload} payload bytes"
            digest.update(into[done : done + got])
            done += got
        return None if digest.intdigest() == header_checksum(head) else "checksum mismatch"
    except OSError as exc:
        return f"unreadable: {exc.strerror}"
    finally:
        os.close(fd)


@dataclasses.dataclass(slots=True)
class Outcome:
    """What a load did: ``landed`` leading objects handed to the sink; ``failed`` the index that stopped
    it (or the count asked for) and ``why``."""

    landed: int
    failed: int
    why: str | None = None


class _Turns:
    """Hands out indices in order and admits index i to land once every index below it was verified."""

    def __init__(self, count: int) -> None:
        self.cond = threading.Condition()
        self.picked = 0
        self.admitted = 0
        self.failed = count
        self.why: str | None = None
        self.error: BaseException | None = None

    def pick(self) -> int | None:
        with self.cond:
            if self.picked >= self.failed:
                return None
            self.picked += 1
            return self.picked - 1

    def verified(self, i: int, why: str | None) -> bool:
        """Record index i's verdict; True when it may land now (waits for the indices below it)."""
        with self.cond:
            if why is not None:
                if i < self.failed:
                    self.failed, self.why = i, why
                self.cond.notify_all()
                return False
            while self.admitted < i and self.failed > self.admitted:
                self.cond.wait()
            if self.admitted < i:  # an index below failed
                return False
            self.admitted = i + 1
            self.cond.notify_all()
            return True

    def abort(self, exc: BaseException) -> None:
        with self.cond:
            self.error = self.error or exc
            self.failed = -1
            self.cond.notify_all()


class Reader:
    """Loads objects with up to ``READ_THREADS`` in flight, landing them in order (see the module)."""

    def __init__(self, identity: ObjectIdentity) -> None:
        self.identity = identity
        self.threads = max(1, min(READ_THREADS, READ_BUFFER_BYTES // max(1, identity.payload)))
        size = round_up(identity.payload)  # page-aligned, and mapped now: a first load takes no page faults
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._buffers = [memoryview(mmap.mmap(-1, size, flags=flags))[: identity.payload] for _ in range(self.threads)]
        self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="kvcached-read")

    def load(
        self, keys: Sequence[bytes], paths: Sequence[Path], sink: Sink, on_progress: Callable[[], None]
    ) -> Outcome:
        """Read ``keys``'s objects at ``paths`` and hand each verified payload to ``sink`` in order."""
        count = len(keys)
        turns = _Turns(count)
        threads = min(self.threads, count)
        if threads == 0:
            return Outcome(0, 0)

        def run(buffer: memoryview) -> None:
            try:
                while (i := turns.pick()) is not None:
                    why = read_object(self.identity, keys[i], paths[i], buffer)
                    if turns.verified(i, why):
                        sink(i, buffer)
                        on_progress()
            except BaseException as exc:
                turns.abort(exc)
                raise

        futures = [self._pool.submit(run, self._buffers[t]) for t in range(threads)]
        concurrent.futures.wait(futures)
        if turns.error is not None:
            raise turns.error
        return Outcome(turns.admitted, turns.failed, turns.why)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


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
    """Write ``key``'s object (the record is the concatenation of ``pieces``) to the new file ``tmp`` and
    start its writeback; its open descriptor. The checksum is taken chunk by chunk just before each write."""
    if sum(len(piece) for piece in pieces) != identity.payload:
        raise ValueError(f"a block record has {identity.payload} bytes, not {sum(len(p) for p in pieces)}")
    fd = os.open(tmp, _WRITE, 0o600)
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
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return fd


@dataclasses.dataclass(slots=True)
class Pending:
    """A written object waiting for its group's durability point."""

    key: bytes
    tmp: Path
    path: Path
    fd: int


class Writer:
    """One store call's objects: written by the caller (``add`` each), made durable and renamed in groups
    by a committer thread; ``finish`` waits for the last group. A failed group ends the call: its
    temporaries and those queued after it are removed, and ``add`` raises what failed."""

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
                    os.fsync(pending.fd)
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
