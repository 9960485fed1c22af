"""The ``file`` backend: one file per (block key, rank) under a directory, with LRU eviction::

    <path>/r<rank>/.lock                       flock: one daemon per rank directory, held for its whole life
    <path>/r<rank>/<k[0:2]>/<key hex>.kvb      an object (header + block record)
    <path>/r<rank>/<k[0:2]>/.tmp-...           a write in progress (removed at start-up if left)

Writes are atomic: each object is written to a temporary file, fsynced and renamed over its final name, so a crash
leaves either no object or a whole one (how stores and loads do their I/O: ``kvcached.store.fileio``). The index (key ->
size, least recently used first) lives in memory and is rebuilt at start-up from a directory scan ordered by mtime,
reading each object's header (not its payload: the checksum is checked on every load); a hit refreshes the file's mtime
so the order survives restarts. Capacity is per rank (the instance's capacity divided by its ranks); storing past it
evicts the least recently used objects, never one written by the same task.

Nor is the disk trusted. A full disk (ENOSPC) evicts as a full capacity does, then the write is retried. Anything at an
object's name that is not a readable regular file of the right size (a directory, a FIFO, a file made unreadable, one
deleted by hand) is a miss, removed where it can be, and leaves the index; a key whose file went missing is rewritten by
its next store. A rank directory removed while the daemon runs is noticed (``check``, from the worker's loop and every
call), reported and made again, its lock retaken at once so no second daemon can start on the same path meanwhile."""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import itertools
import os
import shutil
import stat
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvcached import knobs
from kvcached.checks import FAIL, OK, WARN, Check, size_text
from kvcached.logs import Logger
from kvcached.protocol.errors import InvalidSpec, StoreBusy, StoreUnavailable
from kvcached.protocol.spec import CacheSpec
from kvcached.store import register
from kvcached.store.base import HEADER_SIZE, ObjectIdentity, Store, StoreBackend, StoreCounters
from kvcached.store.filedirs import default_storage_path, full_disk, nearest_existing, unsafe_directory
from kvcached.store.fileio import MISSING, READ_FLAGS, Pending, Reader, Writer, write_temporary
from kvcached.store.landing import Targets

SUFFIX = ".kvb"
BUSY = "one daemon per store directory: stop the other one, or give this instance another --storage-path"
#: How long a lock held by someone else is waited for: a replaced worker's store agent, killed with it, lets go
#: of it only once it has exited, which under load can take a moment after its successor asks.
LOCK_WAIT_S = 3.0


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
        self.reader = Reader(identity)
        self._lock_fd = -1
        self._dir_ino = 0
        self._refused = ""  # why the directory in the rank's place is refused, once said
        self._take_directory()
        self._rebuild()

    def _take_directory(self) -> None:
        """Make the rank directory if needed and take its lock: ``StoreBusy`` if another holds it past ``LOCK_WAIT_S``,
        ``InvalidSpec`` (changing nothing) if another user could plant objects in it (``unsafe_directory``)."""
        for path in (self.dir.parent, self.dir):
            path.mkdir(exist_ok=True, mode=0o700, parents=True)
            if (why := unsafe_directory(path)) is not None:
                raise InvalidSpec("storage_path", why)
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    raise StoreBusy(f"{self.dir} is used by another kvcached daemon; {BUSY}") from None
                time.sleep(0.05)
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
        self._lock_fd = fd
        self._dir_ino = os.stat(self.dir).st_ino

    def check(self) -> None:
        """Notice the rank directory gone or replaced and make it anew, empty (see the module); one this daemon may not
        use (``unsafe_directory``) is refused: ``StoreUnavailable`` naming it and the fix, logged once, until fixed."""
        try:
            same = os.stat(self.dir).st_ino == self._dir_ino and os.path.exists(self.dir / ".lock")
        except FileNotFoundError:
            same = False
        if same:
            return
        self.counters.errors += 1
        try:
            self._take_directory()  # StoreBusy if another daemon took it meanwhile: every store call says so
        except InvalidSpec as exc:
            if str(exc) != self._refused:
                self.log.warning("store directory replaced; store tasks fail until it is fixed", reason=str(exc))
            self._refused = str(exc)
            raise StoreUnavailable(str(exc)) from None
        self._refused = ""
        self.log.error("store directory removed while the daemon runs; making it again", path=str(self.dir))
        self.index.clear()
        self.counters.objects = self.counters.bytes = 0

    def _path(self, key: bytes) -> str:
        name = key.hex()
        return f"{self.dir}/{name[:2]}/{name}{SUFFIX}"

    def _rebuild(self) -> None:
        """Index every object by mtime; remove writes a crash left half-done."""
        found = []
        uid = os.geteuid()
        subs = [sub.path for sub in os.scandir(self.dir) if sub.is_dir()]  # a link to one too: writes would follow it
        for refusal in filter(None, map(unsafe_directory, map(Path, subs))):  # before anything is removed
            raise InvalidSpec("storage_path", refusal)
        for prefix in range(256):  # each object's subdirectory (``_path``): a new store's first writes make none
            with contextlib.suppress(OSError):
                os.mkdir(f"{self.dir}/{prefix:02x}", 0o700)
        for sub in subs:
            for entry in os.scandir(sub):
                if entry.name.startswith(".tmp-"):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                    continue
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(entry.name[: -len(SUFFIX)])
                    st = entry.stat(follow_symlinks=False)
                    head = self._read(entry.path, HEADER_SIZE) if stat.S_ISREG(st.st_mode) else b""
                except (ValueError, OSError):
                    head = b""
                    st = None
                why = self.identity.verify_header(key, memoryview(head), st.st_size) if st and head else "unreadable"
                if st and (st.st_uid != uid or st.st_mode & 0o022):
                    why = f"written by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}, not by this daemon"
                if why is not None:
                    self.log.warning("store object unusable, removed", path=entry.path, reason=why)
                    _remove(entry.path)
                    self.counters.corrupt += 1
                    continue
                assert st is not None
                found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self.index[key] = size
            self.counters.bytes += size
        self.counters.objects = len(self.index)
        self._evict()

    @staticmethod
    def _read(path: str, size: int) -> bytes:
        fd = os.open(path, READ_FLAGS)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            return os.read(fd, size)
        finally:
            os.close(fd)

    def _forget(self, key: bytes) -> None:
        size = self.index.pop(key, None)
        if size is not None:
            self.counters.bytes -= size
            self.counters.objects -= 1

    def _evict(self, need: int = 0) -> None:
        """Evict least recently used objects (never protected ones) until ``need`` more bytes fit the capacity."""
        while self.counters.bytes + need > self.capacity and self._evict_one():
            pass

    def _evict_one(self) -> bool:
        """Evict the least recently used unprotected object (a full disk, or past the capacity); False if none."""
        victim = next((k for k in self.index if k not in self._protected), None)
        if victim is None:
            return False
        _remove(self._path(victim))
        self._forget(victim)
        self.counters.evictions += 1
        return True

    def protect(self, keys: Sequence[bytes]) -> None:
        self._protected = set(keys)

    def put_many(self, keys: Sequence[bytes], pieces: Sequence[Sequence[memoryview]]) -> int:
        """Write each new object to a temporary file while a committer thread fsyncs and renames them in groups
        (``kvcached.store.fileio``). Objects committed before a failure stay stored; the others are removed."""
        self.check()
        writer = Writer(self.on_progress)
        queued: list[bytes] = []
        try:
            for key, parts in zip(keys, pieces, strict=True):
                if key in queued:
                    continue
                if self._on_disk(key):
                    self.index.move_to_end(key)  # stored already: used again
                    continue
                size = HEADER_SIZE + self.identity.payload
                self._evict(size)
                writer.add(self._write_temporary(key, parts))
                self.index[key] = size
                self.counters.bytes += size
                self.counters.objects += 1
                queued.append(key)
                self.on_progress()
        except BaseException:
            self.counters.errors += 1
            raise
        finally:
            committed = set(writer.finish())
            for key in queued:
                if key not in committed:
                    self._forget(key)
        if writer.error is not None:
            self.counters.errors += 1
            raise writer.error
        return len(committed)

    def _on_disk(self, key: bytes) -> bool:
        """Whether ``key`` is indexed and on disk (one deleted by hand leaves the index; the next store rewrites it)."""
        if key in self.index and os.path.isfile(self._path(key)):
            return True
        self._forget(key)
        return False

    def _write_temporary(self, key: bytes, pieces: Sequence[memoryview]) -> Pending:
        """Write ``key``'s object to a temporary file beside its name; a full disk evicts and tries again."""
        path = Path(self._path(key))
        path.parent.mkdir(exist_ok=True, mode=0o700)
        while True:
            tmp = path.parent / f".tmp-{os.getpid()}-{next(self._tmp)}"
            try:
                return Pending(key, tmp, path, write_temporary(self.identity, tmp, key, pieces))
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                if not self._evict_one():
                    raise type(exc)(exc.errno, f"{exc.strerror}; {full_disk(self.dir.parent)}") from None

    def load_prefix(self, keys: Sequence[bytes], targets: Targets) -> int:
        """Read the leading indexed keys' objects, several at once, each straight into its target and verified as it is
        read (``kvcached.store.fileio.Reader``); the first that fails is a miss and is removed."""
        self.check()
        indexed = next((i for i, key in enumerate(keys) if key not in self.index), len(keys))
        paths = [self._path(key) for key in keys[:indexed]]
        outcome = self.reader.load(keys[:indexed], paths, targets, self.on_progress)
        for key in keys[: outcome.landed]:
            self.index.move_to_end(key)
        self.counters.hits += outcome.landed
        if outcome.landed < len(keys):
            self.counters.misses += 1
        if outcome.why is not None:
            key, path = keys[outcome.landed], paths[outcome.landed]
            self.log.warning("store object unusable, removed", key=key.hex(), path=path, reason=outcome.why)
            _remove(path)
            self._forget(key)
            self.counters.corrupt += outcome.why != MISSING
        return outcome.landed

    def present(self, keys: Sequence[bytes]) -> int:
        """How many leading keys are indexed and still on disk (``_on_disk``: one stat each)."""
        self.check()
        return next((i for i, key in enumerate(keys) if not self._on_disk(key)), len(keys))

    def close(self) -> None:
        self.reader.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def _remove(path: str | Path) -> None:
    """Remove whatever is at ``path`` (a file, a FIFO, a directory), as far as we may."""
    with contextlib.suppress(OSError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)


class FileBackend(StoreBackend):
    name = "file"
    direct = True  # its objects are files: an agent killed at a timeout loses nothing but that call
    options = (
        knobs.Knob(
            "storage_path",
            knobs.optional_text,
            None,
            "file backend: directory of the objects. [default: ~/.cache/kvcached/<instance>/store ($XDG_CACHE_HOME "
            "for ~/.cache; under systemd $CACHE_DIRECTORY/<instance>/store)]",
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
        given = values.get("storage_path")
        path = Path(given or default_storage_path(instance)).expanduser().absolute()
        try:
            existing = nearest_existing(path)
        except OSError as exc:  # a name the kernel cannot even look at (too long, a loop of links)
            raise InvalidSpec("storage_path", f"{path}: {exc.strerror}") from None
        longest = len(os.fsencode(f"{path}/r{ranks - 1}/00/{'0' * 64}{SUFFIX}"))  # an object's name: 32-byte key
        if longest >= (limit := os.pathconf(existing, "PC_PATH_MAX")):
            raise InvalidSpec(
                "storage_path",
                f"{path} is too long: its objects' names would take {longest} bytes, past this system's {limit - 1}",
            )
        if existing != path and not os.access(existing, os.W_OK | os.X_OK):
            default = ""
            if not given:
                home = Path.home()
                default = f" (the default, under HOME={home}{'' if home.exists() else ', which does not exist'})"
            raise InvalidSpec(
                "storage_path",
                f"cannot make {path}{default}: {existing} is not writable by this user; set --storage-path to a "
                "directory it may write",
            )
        return {"storage_path": str(path), "storage_capacity": capacity}

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
        existing = nearest_existing(path)
        free = shutil.disk_usage(existing).free
        holders = _held_ranks(path, ranks)
        measured = {"path": str(path), "free_bytes": free, "capacity_bytes": capacity, "held_ranks": holders}
        figure = f"{path}: {size_text(free)} free for a capacity of {size_text(capacity)}"
        if not os.access(existing, os.W_OK):
            return [Check("file_store", FAIL, figure, measured, f"{existing} is not writable by this user")]
        for directory in [path, *(path / f"r{rank}" for rank in range(ranks))]:
            if directory.is_dir() and (why := unsafe_directory(directory)) is not None:
                return [Check("file_store", FAIL, f"{figure}; not safe", measured, why)]
        if holders:
            advice = f"another daemon holds the directories of ranks {holders}; {BUSY}"
            return [Check("file_store", FAIL, f"{figure}; in use", measured, advice)]
        if free < capacity:
            return [Check("file_store", WARN, figure, measured, "the disk fills before the store reaches its capacity")]
        return [Check("file_store", OK, figure, measured)]

    def start_warnings(self, options: Mapping[str, Any], ranks: int) -> list[str]:
        path, capacity = Path(options["storage_path"]), options["storage_capacity"]
        free = shutil.disk_usage(nearest_existing(path)).free
        if free >= capacity:
            return []
        return [
            f"--storage-capacity {size_text(capacity)} exceeds the {size_text(free)} free on the disk of {path}: "
            "the disk fills before the store evicts (stores then fail with ENOSPC, the rank serves on)"
        ]


def _held_ranks(path: Path, ranks: int) -> list[int]:
    """Ranks whose store directory's lock another process holds now (probed with a non-blocking flock)."""
    held = []
    for rank in range(ranks):
        try:
            fd = os.open(path / f"r{rank}" / ".lock", os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.append(rank)
        finally:
            os.close(fd)
    return held


register(FileBackend())
