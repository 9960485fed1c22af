"""The ``file`` backend: one file per (block key, rank) under a directory, with LRU eviction.

::

    <path>/r<rank>/.lock                       flock: one daemon per rank directory
    <path>/r<rank>/<k[0:2]>/<key hex>.kvb      an object (header + block record)
    <path>/r<rank>/<k[0:2]>/.tmp-...           a write in progress (removed at start-up if left)

Writes are atomic: a temporary file is written (``writev`` straight from the device arena, no gather
copy), fsynced and renamed over the final name, so a crash leaves either no object or a whole one. The
index (key -> size, least recently used first) lives in memory and is rebuilt at start-up from a
directory scan ordered by mtime, reading each object's header (not its payload: the checksum is checked
on every load); a hit refreshes the file's mtime so the order survives restarts.
Capacity is per rank (the instance's capacity divided by its ranks); storing past it evicts the least
recently used objects, never one written by the same task.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import itertools
import mmap
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvcached import knobs
from kvcached.health import FAIL, OK, WARN, Check, size_text
from kvcached.logs import Logger
from kvcached.protocol.errors import InvalidSpec, StoreBusy
from kvcached.protocol.layout import round_up
from kvcached.protocol.spec import CacheSpec
from kvcached.store import register
from kvcached.store.base import HEADER_SIZE, ObjectIdentity, Sink, Store, StoreBackend, StoreCounters, checksum

SUFFIX = ".kvb"


class FileStore(Store):
    """One rank's objects in ``root/r<rank>``."""

    def __init__(self, root: Path, *, identity: ObjectIdentity, capacity: int, log: Logger) -> None:
        self.dir = root / f"r{identity.rank}"
        self.identity = identity
        self.capacity = capacity
        self.log = log
        self.counters = StoreCounters()
        self.index: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._tmp = itertools.count()
        self._protected: set[bytes] = set()
        self.staging = memoryview(mmap.mmap(-1, round_up(HEADER_SIZE + identity.payload)))[
            : HEADER_SIZE + identity.payload
        ]
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock_fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StoreBusy(f"{self.dir} is used by another kvcached daemon") from None
        self._rebuild()

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / (name + SUFFIX)

    def _rebuild(self) -> None:
        """Index every object by mtime; remove writes a crash left half-done."""
        found = []
        for sub in os.scandir(self.dir):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                if entry.name.startswith(".tmp-"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(entry.name[: -len(SUFFIX)])
                    st = entry.stat(follow_symlinks=False)
                    with open(entry.path, "rb", buffering=0) as f:
                        head = f.read(HEADER_SIZE)
                except (ValueError, OSError):
                    continue
                why = self.identity.verify_header(key, memoryview(head), st.st_size)
                if why is not None:
                    self.log.warning("store object unusable, removed", path=entry.path, reason=why)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(entry.path)
                    self.counters.corrupt += 1
                    continue
                found.append((st.st_mtime_ns, key, st.st_size))
        found.sort()
        for _, key, size in found:
            self.index[key] = size
            self.counters.bytes += size
        self.counters.objects = len(self.index)
        self._evict()

    def _forget(self, key: bytes) -> None:
        size = self.index.pop(key, None)
        if size is not None:
            self.counters.bytes -= size
            self.counters.objects -= 1

    def _evict(self) -> None:
        while self.counters.bytes > self.capacity and self.index:
            victim = next((k for k in self.index if k not in self._protected), None)
            if victim is None:
                return
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path(victim))
            self._forget(victim)
            self.counters.evictions += 1

    def protect(self, keys: Sequence[bytes]) -> None:
        self._protected = set(keys)

    def put_many(self, keys: Sequence[bytes], pieces: Sequence[Sequence[memoryview]]) -> int:
        return sum(self.put(key, parts) for key, parts in zip(keys, pieces, strict=True))

    def put(self, key: bytes, pieces: Sequence[memoryview]) -> bool:
        """Store one block record under ``key``; False if it was there already."""
        if key in self.index:
            self.index.move_to_end(key)
            return False
        path = self._path(key)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        tmp = path.parent / f".tmp-{os.getpid()}-{next(self._tmp)}"
        data = [memoryview(self.identity.header(key, checksum(pieces))), *pieces]
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            while data:
                written = os.writev(fd, data)
                while data and written >= len(data[0]):
                    written -= len(data[0])
                    data.pop(0)
                if data and written:
                    data[0] = data[0][written:]
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, path)
        size = HEADER_SIZE + self.identity.payload
        self.index[key] = size
        self.counters.bytes += size
        self.counters.objects += 1
        self._evict()
        return True

    def load_prefix(self, keys: Sequence[bytes], sink: Sink) -> int:
        for i, key in enumerate(keys):
            payload = self.get(key)
            if payload is None:
                return i
            sink(i, payload)
        return len(keys)

    def get(self, key: bytes) -> memoryview | None:
        """Read and verify ``key``'s object into the staging buffer; its payload, or None for a miss
        (absent, or failed verification, in which case it is removed)."""
        staging = self.staging
        if key not in self.index:
            self.counters.misses += 1
            return None
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                got = f.readinto(staging)
                extra = f.read(1)  # a file longer than an object is not one
        except FileNotFoundError:
            got, extra = -1, b""
        why = "missing" if got < 0 else ("longer than an object" if extra else None)
        data = staging[: max(got, 0)]
        why = why or self.identity.verify(key, data)
        if why is not None:
            self.log.warning("store object unusable, removed", key=key.hex(), path=str(path), reason=why)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self._forget(key)
            self.counters.corrupt += 1
            self.counters.misses += 1
            return None
        self.index.move_to_end(key)
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)
        self.counters.hits += 1
        return data[HEADER_SIZE:]

    def present(self, keys: Sequence[bytes]) -> int:
        count = 0
        for key in keys:
            if key not in self.index:
                break
            count += 1
        return count

    def close(self) -> None:
        os.close(self._lock_fd)


def default_storage_path(instance: str) -> Path:
    """``$CACHE_DIRECTORY/<instance>/store`` under systemd (CacheDirectory=), else the user's cache directory."""
    base = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if not base:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        base = str(Path(base) / "kvcached")
    return Path(base) / instance / "store"


class FileBackend(StoreBackend):
    """The ``file`` backend (see the module docstring)."""

    name = "file"
    summary = "one file per object under a directory (embedded)"
    options = (
        knobs.Knob(
            "storage_path",
            knobs.optional_text,
            None,
            "file backend: directory of the objects. [default: $CACHE_DIRECTORY or ~/.cache/kvcached/<instance>/store]",
            metavar="DIR",
        ),
        knobs.Knob(
            "storage_capacity",
            knobs.size,
            "8GiB",
            "file backend: capacity of the whole instance (512MiB, 8GiB, ...); least recently used objects are "
            "evicted past it.",
            metavar="BYTES",
        ),
    )

    def configure(self, values: Mapping[str, Any], *, spec: CacheSpec, instance: str, ranks: int) -> dict[str, Any]:
        capacity = knobs.size(values.get("storage_capacity", "8GiB"))
        smallest = ranks * (HEADER_SIZE + spec.block_bytes)
        if capacity < smallest:
            raise InvalidSpec(
                "storage_capacity",
                f"{capacity} bytes cannot hold one block per rank ({smallest} bytes for {ranks} ranks)",
            )
        path = values.get("storage_path") or str(default_storage_path(instance))
        return {"storage_path": str(Path(path).expanduser().absolute()), "storage_capacity": capacity}

    def open(
        self, options: Mapping[str, Any], *, identity: ObjectIdentity, rank: int, ranks: int, log: Logger
    ) -> Store:
        store = FileStore(
            Path(options["storage_path"]), identity=identity, capacity=options["storage_capacity"] // ranks, log=log
        )
        log.info("file store opened", path=str(store.dir), objects=store.counters.objects, bytes=store.counters.bytes)
        return store

    def doctor(self, options: Mapping[str, Any], ranks: int) -> list[Check]:
        path, capacity = Path(options["storage_path"]), options["storage_capacity"]
        existing = path
        while not existing.exists():
            existing = existing.parent
        free = shutil.disk_usage(existing).free
        measured = {"path": str(path), "free_bytes": free, "capacity_bytes": capacity}
        figure = f"{path}: {size_text(free)} free for a capacity of {size_text(capacity)}"
        if not os.access(existing, os.W_OK):
            return [Check("file_store", FAIL, figure, measured, f"{existing} is not writable by this user")]
        if free < capacity:
            return [Check("file_store", WARN, figure, measured, "the disk fills before the store reaches its capacity")]
        return [Check("file_store", OK, figure, measured)]


register(FileBackend())
