"""The file store's I/O path: loads with several objects in flight report only a verified prefix, and the
store agent, which reads and writes the device blocks itself, is replaced when it stops in a call."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import runner_client as rc
from kvcached.status import read_status
from tests.conftest import DaemonFactory
from tests.helpers.procs import halt
from tests.test_faults import small_disk

__all__ = ["small_disk"]  # a fixture: a 4 MiB tmpfs

BLOCKS = 16
FLAGS = ["--num-layers", "3", "--kv-heads", "2", "--head-dim", "64", "--block-size", "64", "--num-blocks", str(BLOCKS)]
FLAGS += ["--num-cpu-blocks", "0"]


def spec() -> rc.CacheSpec:
    return rc.CacheSpec(num_layers=3, kv_heads=2, head_dim=64, block_size=64, num_blocks=BLOCKS, storage_backend="file")


def start(daemons: DaemonFactory, path: Path, *extra: str) -> str:
    daemon = daemons.start(ranks=1, args=[*FLAGS, "--storage-backend", "file", "--storage-path", str(path), *extra])
    daemon.wait_ready()
    return daemon.instance


def blocks(cache: rc.KVCache, ids: list[int]) -> list[bytes]:
    return [b"".join(t[i].tobytes() for t in cache.key_caches + cache.value_caches) for i in ids]


def fill(cache: rc.KVCache, ids: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for t in cache.key_caches + cache.value_caches:
        raw = t.view(np.uint8)
        raw[ids] = rng.integers(0, 256, raw[ids].shape, dtype=np.uint8)


def object_path(root: Path, key: bytes) -> Path:
    return root / "r0" / key.hex()[:2] / f"{key.hex()}.kvb"


def store_agent(instance: str) -> int:
    """The pid of rank 0's store agent: its worker's one child."""
    worker = read_status(instance)["ranks"][0]["pid"]
    children = Path(f"/proc/{worker}/task/{worker}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def test_a_long_load_lands_only_the_verified_prefix(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Eight objects, the fifth damaged in its payload: a load of all eight, read several at a time, reports
    four, each holding its object's bytes; no block outside the load's targets changes (the targets of the
    fifth and later ones may hold bytes of the load: they are not reported); only the damaged object is
    removed, the later ones stay stored, and only the four reported have their mtime refreshed (the least
    recently used order a restart rebuilds: set as each is read, and put back for those read but not reported)."""
    path = tmp_path / "store"
    instance = start(daemons, path)
    keys = rc.block_keys(list(range(8 * 64)), 64)
    with rc.initialize_kv_cache(spec(), 0, instance=instance) as cache, rc.CacheTasks(instance) as tasks:
        fill(cache, list(range(8)), seed=1)
        expected = blocks(cache, list(range(8)))
        assert tasks.store(0, list(range(8)), keys).blocks == 8
        victim = object_path(path, keys[4])
        raw = bytearray(victim.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        victim.write_bytes(raw)
        for key in keys:
            os.utime(object_path(path, key), ns=(10**9, 10**9))
        fill(cache, list(range(8, 16)), seed=2)
        assert tasks.load(0, keys, list(range(8, 16))).blocks == 4
        times = [object_path(path, key).stat().st_mtime_ns for key in keys[:4] + keys[5:]]
        assert min(times[:4]) > 10**9 and times[4:] == [10**9] * 3, "only the reported objects count as used"
        assert blocks(cache, list(range(8, 12))) == expected[:4], "every reported block holds its object's bytes"
        assert blocks(cache, list(range(8))) == expected, "no block outside the load's targets changed"
        assert not victim.exists()
        assert [tasks.lookup([key]) for key in keys] == [1, 1, 1, 1, 0, 1, 1, 1]
    assert read_status(instance)["ranks"][0]["store"]["corrupt"] == 1


def test_a_store_agent_stopped_in_a_load_is_replaced(daemons: DaemonFactory, tmp_path: Path) -> None:
    """The store agent frozen (SIGSTOP) while it serves a load into device blocks: the load fails with
    StoreUnavailable within the store timeout, the frozen agent is killed (so nothing it had under way can
    land later) and a new one serves the next loads; the rank's worker is the same throughout."""
    instance = start(daemons, tmp_path / "store", "--store-timeout", "2")
    keys = rc.block_keys(list(range(4 * 64)), 64)
    worker = read_status(instance)["ranks"][0]["pid"]
    with rc.initialize_kv_cache(spec(), 0, instance=instance) as cache, rc.CacheTasks(instance, timeout=60) as tasks:
        fill(cache, [0, 1, 2, 3], seed=3)
        expected = blocks(cache, [0, 1, 2, 3])
        tasks.store(0, [0, 1, 2, 3], keys)
        frozen = store_agent(instance)
        halt(frozen)
        started = time.monotonic()
        with pytest.raises(rc.StoreUnavailable, match="agent was stopped"):
            tasks.load(0, keys, [4, 5, 6, 7])
        assert time.monotonic() - started < 10
        assert not Path(f"/proc/{frozen}").exists(), "the frozen agent was killed and reaped"
        deadline = time.monotonic() + 30
        while True:
            try:
                assert tasks.load(0, keys, [8, 9, 10, 11]).blocks == 4
                break
            except rc.StoreUnavailable:  # the new agent is still opening the store
                assert time.monotonic() < deadline, "no new store agent within 30 s"
                time.sleep(0.2)
        assert blocks(cache, [8, 9, 10, 11]) == expected
        assert store_agent(instance) != frozen
    assert read_status(instance)["ranks"][0]["pid"] == worker


def test_a_store_agent_killed_while_idle_is_replaced(daemons: DaemonFactory, tmp_path: Path) -> None:
    """The store agent killed (kill -9) while no task runs: the worker sees it gone between tasks, starts a
    new one and keeps serving; the daemon and the rank's worker are the same throughout, and the next loads
    land every stored block byte for byte."""
    path = tmp_path / "store"
    daemon = daemons.start(ranks=1, args=[*FLAGS, "--storage-backend", "file", "--storage-path", str(path)])
    daemon.wait_ready()
    instance = daemon.instance
    keys = rc.block_keys(list(range(4 * 64)), 64)
    worker = read_status(instance)["ranks"][0]["pid"]
    with rc.initialize_kv_cache(spec(), 0, instance=instance) as cache, rc.CacheTasks(instance, timeout=60) as tasks:
        fill(cache, [0, 1, 2, 3], seed=4)
        expected = blocks(cache, [0, 1, 2, 3])
        assert tasks.store(0, [0, 1, 2, 3], keys).blocks == 4
        killed = store_agent(instance)
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{killed}").exists():  # reaped by the worker's check between tasks
            assert daemon.proc.poll() is None, f"the daemon ended:\n{daemon.log()[-3000:]}"
            assert time.monotonic() < deadline, "the dead agent was never reaped"
            time.sleep(0.1)
        while True:
            try:
                assert tasks.load(0, keys, [4, 5, 6, 7]).blocks == 4
                break
            except rc.StoreUnavailable:  # the new agent is still opening the store
                assert time.monotonic() < deadline, "no new store agent within 30 s"
                time.sleep(0.2)
        assert blocks(cache, [4, 5, 6, 7]) == expected
        assert store_agent(instance) != killed
    assert daemon.proc.poll() is None, f"the daemon ended:\n{daemon.log()[-3000:]}"
    assert read_status(instance)["ranks"][0]["pid"] == worker


def test_status_says_a_replaced_agent_s_store_is_unavailable_until_it_has_opened(
    daemons: DaemonFactory, tmp_path: Path
) -> None:
    """The store agent killed, and its rank directory's lock taken by another process the moment it lets go:
    the agent the worker starts in its place waits for the lock (``LOCK_WAIT_S``), and meanwhile ``kvcached
    status`` says the rank's store is unavailable (a client that waits for it to say available finds it open);
    once the lock is let go, available, and stores work."""
    import fcntl

    from tests.conftest import availability

    path = tmp_path / "store"
    instance = start(daemons, path)
    killed = store_agent(instance)
    fd = os.open(path / "r0" / ".lock", os.O_RDWR)
    try:
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:  # the lock, the moment the killed agent lets go of it
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() < deadline, "the killed agent kept the lock"
        worker = read_status(instance)["ranks"][0]["pid"]
        children = Path(f"/proc/{worker}/task/{worker}/children")
        while children.read_text().split() in ([], [str(killed)]):  # until the worker has started another
            assert time.monotonic() < deadline, "no new store agent within 10 s"
            time.sleep(0.05)
        seen = set()
        until = time.monotonic() + 1.0
        while time.monotonic() < until:  # the new agent waits for the lock meanwhile (LOCK_WAIT_S)
            seen.add(availability(instance)[0])
            time.sleep(0.1)
        assert seen == {False}, "the store is said available before its new agent opened it"
    finally:
        os.close(fd)
    deadline = time.monotonic() + 30
    while not availability(instance)[0]:
        assert time.monotonic() < deadline, "the new agent never opened the store"
        time.sleep(0.1)
    with rc.CacheTasks(instance) as tasks:
        assert tasks.store(0, [0], rc.block_keys(list(range(64)), 64)).blocks == 1


def test_a_store_on_a_full_disk_fails_saying_so_once_and_where(daemons: DaemonFactory, small_disk: Path) -> None:
    """A store whose disk is full with nothing of the store's own to evict fails its task with one
    message that says what happened once (no doubled ``[Errno 28]``) and which file it was writing; the
    rank serves on."""
    path = small_disk / "s"
    instance = start(daemons, path, "--storage-capacity", "1GiB")
    with open(small_disk / "ballast", "wb") as ballast, contextlib.suppress(OSError):
        while True:
            ballast.write(b"\1" * 65536)
            ballast.flush()
    keys = rc.block_keys(list(range(2 * 64)), 64)
    with rc.CacheTasks(instance) as tasks:
        with pytest.raises(rc.TaskFailed) as failed:
            tasks.store(0, [0, 1], keys)
        message = str(failed.value)
        assert message.count("No space left on device") == 1 and message.count("Errno") <= 1, message
        assert f"cannot write store object {path / 'r0'}" in message and "nothing left to evict" in message, message
        (small_disk / "ballast").unlink()
        assert tasks.store(0, [0, 1], keys).blocks == 2


@pytest.mark.parametrize("kind", ["native", "python"])
def test_each_object_read_says_what_is_wrong_with_it(kind: str, tmp_path: Path) -> None:
    """A load's verdict on each kind of object, the same with the native routines (the open, the checks, the
    header and the payload in one call) as in Python: a whole object lands byte for byte and verifies; a
    missing file is a miss; a FIFO, a file of another size, a symbolic link, a header of another key and a
    flipped payload byte each say so; none raises."""
    from kvcached import native
    from kvcached.native import Side
    from kvcached.store.base import ObjectIdentity
    from kvcached.store.fileio import MISSING, Reader, write_temporary
    from kvcached.store.landing import Targets

    if kind == "native" and not native.available():
        pytest.skip("the native copy was not built here")
    identity = ObjectIdentity(digest=b"d" * 16, rank=0, payload=3 * 4096)
    arena = np.zeros((4, 3, 4096), dtype=np.uint8)
    targets = Targets(Side.of([arena[:, p, :] for p in range(3)]), [2])
    record = np.random.default_rng(7).integers(0, 256, identity.payload, dtype=np.uint8)
    key = b"k" * 32

    def object_at(name: str, data: np.ndarray = record, key: bytes = key) -> Path:
        path = tmp_path / name
        os.close(write_temporary(identity, path, key, [memoryview(data)]))
        return path

    with open(object_at("flipped"), "r+b") as f:  # one payload byte flipped after it was written
        f.seek(128 + 5000)
        byte = f.read(1)[0]
        f.seek(128 + 5000)
        f.write(bytes([byte ^ 1]))
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "short").write_bytes(object_at("whole").read_bytes()[:228])
    (tmp_path / "link").symlink_to(tmp_path / "whole")
    cases = {
        "whole": None,
        "nothing": MISSING,
        "fifo": "not a regular file",
        "short": f"228 bytes, an object has {128 + identity.payload}",
        "link": "unreadable: Too many levels of symbolic links",
        "flipped": "checksum mismatch",
    }
    saved = native._LIBRARY
    if kind == "python":
        native._LIBRARY = None
    reader = Reader(identity)
    try:

        def verdict(name: str, key: bytes = key) -> str | None:
            outcome = reader.load([key], [tmp_path / name], targets, lambda: None)
            assert outcome.landed == (1 if outcome.why is None else 0), outcome
            return outcome.why

        verdicts = {name: verdict(name) for name in cases}
        other_key = verdict("whole", b"o" * 32)
        object_at("again")
        arena[:] = 0
        again = verdict("again")
    finally:
        native._LIBRARY = saved
        reader.close()
    assert verdicts == cases
    assert other_key is not None and "key" in other_key
    assert again is None
    assert np.array_equal(arena[2].reshape(-1), record) and not arena[[0, 1, 3]].any()


def reads_of(tmp_path: Path, count: int, bad: int | None = None) -> tuple[Any, Any, Any, list[bytes]]:
    """``count`` objects (a 12 KiB payload in three pieces, object ``i``'s every byte ``i + 1``) written under
    ``tmp_path``, object ``bad``'s payload changed at one byte after its header: (their identity, their targets
    over a zeroed arena of ``count`` blocks, the arena, the keys)."""
    from kvcached.native import Side
    from kvcached.store.base import ObjectIdentity
    from kvcached.store.fileio import write_temporary
    from kvcached.store.landing import Targets

    identity = ObjectIdentity(digest=b"d" * 16, rank=0, payload=3 * 4096)
    arena = np.zeros((count, 3, 4096), dtype=np.uint8)
    targets = Targets(Side.of([arena[:, p, :] for p in range(3)]), list(range(count)))
    keys = [bytes([i]) * 32 for i in range(count)]
    for i, key in enumerate(keys):
        os.close(
            write_temporary(identity, tmp_path / str(i), key, [memoryview(np.full(identity.payload, i + 1, np.uint8))])
        )
    if bad is not None:  # after the header: its checksum is of the bytes before
        with open(tmp_path / str(bad), "r+b") as f:
            f.seek(128 + 5000)
            f.write(b"\0")
    return identity, targets, arena, keys


@pytest.mark.parametrize("kind", ["native", "python"])
def test_a_load_takes_nothing_past_an_object_that_fails_its_checksum(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One reader thread, six objects, the second's payload changed after its header was written: the load
    reports one, and reads none past the second (their blocks stay zero), where it used to read them all for
    nothing: a rotten object costs one object's read, not the load's."""
    from kvcached import native
    from kvcached.store import fileio

    if kind == "native" and not native.available():
        pytest.skip("the native copy was not built here")
    if kind == "python":
        monkeypatch.setattr(native, "_LIBRARY", None)
    monkeypatch.setattr(fileio, "READ_THREADS", 1)
    identity, targets, arena, keys = reads_of(tmp_path, 6, bad=1)
    reader = fileio.Reader(identity)
    try:
        outcome = reader.load(keys, [tmp_path / str(i) for i in range(6)], targets, lambda: None)
    finally:
        reader.close()
    assert (outcome.landed, outcome.why) == (1, "checksum mismatch")
    assert (arena[0] == 1).all() and not arena[2:].any()


@pytest.mark.parametrize("kind", ["native", "python"])
def test_an_object_with_any_header_byte_changed_is_refused(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load reports only objects whose every checked header byte is as written: with one bit of any of the
    first 88 bytes flipped (magic, version, sizes, geometry, key, rank, checksum) the object is refused,
    saying why; only the flags (bytes 76-79, not checked without a secret) may differ. The native reads are
    the whole verdict on the objects they report, so they must refuse the same bytes Python does."""
    from kvcached import native
    from kvcached.store import fileio
    from kvcached.store.base import HEADER

    if kind == "native" and not native.available():
        pytest.skip("the native copy was not built here")
    if kind == "python":
        monkeypatch.setattr(native, "_LIBRARY", None)
    identity, targets, arena, keys = reads_of(tmp_path, 1)
    path = tmp_path / "0"
    whole = path.read_bytes()
    reader = fileio.Reader(identity)
    try:
        taken = []
        for offset in range(HEADER.size):
            path.write_bytes(whole[:offset] + bytes([whole[offset] ^ 1]) + whole[offset + 1 :])
            outcome = reader.load(keys, [path], targets, lambda: None)
            assert (outcome.landed == 0) == (outcome.why is not None), (offset, outcome)
            if outcome.landed:
                taken.append(offset)
        path.write_bytes(whole)
        arena[:] = 0
        assert reader.load(keys, [path], targets, lambda: None).landed == 1
        assert (arena[0] == 1).all()
    finally:
        reader.close()
    assert taken == [76, 77, 78, 79]


def twelve_large_targets(kind: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, np.ndarray, Any]:
    """For a test of ``kind`` (native or python reads; skipped where the native ones were not built): an identity
    of 768 KiB payloads, a zeroed arena of twelve such blocks, and its targets (block i for object i). Objects
    this large keep four reader threads reading at once."""
    from kvcached import native
    from kvcached.native import Side
    from kvcached.store.base import ObjectIdentity
    from kvcached.store.landing import Targets

    if kind == "native" and not native.available():
        pytest.skip("the native copy was not built here")
    if kind == "python":
        monkeypatch.setattr(native, "_LIBRARY", None)
    identity = ObjectIdentity(digest=b"d" * 16, rank=0, payload=3 * (256 << 10))
    arena = np.zeros((12, 3, 256 << 10), dtype=np.uint8)
    return identity, arena, Targets(Side.of([arena[:, p, :] for p in range(3)]), list(range(12)))


@pytest.mark.parametrize("kind", ["native", "python"])
def test_a_load_counts_as_used_only_the_objects_it_reports(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each object a load reports has its file's times set to now (the least recently used order a restart
    rebuilds) by the time the load returns; objects the reader threads read past the first that fails (the
    first object's payload changed) are not reported, and their times are as they were, to the nanosecond.
    Whether a thread reads past the failure is a race, made likely by dropping the failing object from the
    page cache before each try (its read waits on the disk while the other threads read on), and the load is
    tried until some thread did (the blocks they landed say so)."""
    from kvcached.store.fileio import Reader, write_temporary

    identity, arena, targets = twelve_large_targets(kind, monkeypatch)
    keys, paths = [bytes([i]) * 32 for i in range(12)], [tmp_path / str(i) for i in range(12)]
    for i, key in enumerate(keys):
        os.close(write_temporary(identity, paths[i], key, [memoryview(np.full(identity.payload, i + 1, np.uint8))]))
    reader = Reader(identity)
    try:
        for path in paths:
            os.utime(path, ns=(10**9, 10**9))
        assert reader.load(keys, paths, targets, lambda: None).landed == 12
        assert all(path.stat().st_mtime_ns > 10**9 for path in paths)
        with open(paths[0], "r+b") as f:
            f.seek(128 + 5000)
            f.write(b"\0")
        read_past = 0
        for _ in range(40):
            for path in paths:
                os.utime(path, ns=(10**9, 10**9))
            fd = os.open(paths[0], os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
            arena[:] = 0
            assert reader.load(keys, paths, targets, lambda: None).landed == 0
            read_past += any(arena[i].any() for i in range(1, 12))
            assert [path.stat().st_mtime_ns for path in paths[1:]] == [10**9] * 11
            if read_past >= 3:
                break
    finally:
        reader.close()
    assert read_past, "no load read past the failed object: the times put back were never tried"


@pytest.mark.parametrize("kind", ["native", "python"])
def test_a_key_asked_for_twice_keeps_the_times_its_reported_copy_set(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys A, B (damaged), then A again and again: A is reported once (index 0) and read again past the failure;
    putting back the times of what was read past it must not put back A's, which its reported copy set (a
    later copy can have read A's times before the first set them)."""
    from kvcached.store.fileio import Reader, write_temporary

    identity, arena, targets = twelve_large_targets(kind, monkeypatch)
    a, b = tmp_path / "a", tmp_path / "b"
    for path, byte in ((a, 1), (b, 2)):
        os.close(
            write_temporary(identity, path, bytes([byte]) * 32, [memoryview(np.full(identity.payload, byte, np.uint8))])
        )
    with open(b, "r+b") as f:
        f.seek(128 + 5000)
        f.write(b"\0")
    keys, paths = [b"\1" * 32, b"\2" * 32] + [b"\1" * 32] * 10, [a, b] + [a] * 10
    reader = Reader(identity)
    try:
        for _ in range(40):
            os.utime(a, ns=(10**9, 10**9))
            arena[0] = 0
            assert reader.load(keys, paths, targets, lambda: None).landed == 1
            assert (arena[0] == 1).all()
            assert a.stat().st_mtime_ns > 10**9, "the reported object's times were put back"
    finally:
        reader.close()


@pytest.mark.parametrize("kind", ["native", "python"])
def test_an_object_whose_times_cannot_be_set_is_served(kind: str, tmp_path: Path) -> None:
    """Objects of another user, readable by all (a store shared read-only, a disk that cannot take the new
    times): a reader that may read them but not set their times serves them all the same, byte for byte, and
    leaves their times as they were. Run as root: the reading is done by a child that becomes uid 65534."""
    from kvcached import native
    from kvcached.native import Side
    from kvcached.store.base import ObjectIdentity
    from kvcached.store.fileio import Reader, write_temporary
    from kvcached.store.landing import Targets

    if os.geteuid() != 0:
        pytest.skip("needs root, to read as another user the files root owns")
    if kind == "native" and not native.available():
        pytest.skip("the native copy was not built here")
    identity = ObjectIdentity(digest=b"d" * 16, rank=0, payload=3 * 4096)
    shared = Path(tempfile.mkdtemp(prefix="kvcached-times-"))  # (tmp_path's parents are closed to others)
    try:
        shared.chmod(0o755)
        keys, paths = [bytes([i]) * 32 for i in range(4)], [shared / str(i) for i in range(4)]
        for i, key in enumerate(keys):
            os.close(write_temporary(identity, paths[i], key, [memoryview(np.full(identity.payload, i + 1, np.uint8))]))
            paths[i].chmod(0o644)
            os.utime(paths[i], ns=(10**9, 10**9))
        arena = np.zeros((4, 3, 4096), dtype=np.uint8)
        child = os.fork()
        if child == 0:  # the reader, as another user
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                if kind == "python":
                    native._LIBRARY = None
                reader = Reader(identity)
                targets = Targets(Side.of([arena[:, p, :] for p in range(3)]), list(range(4)))
                landed = reader.load(keys, paths, targets, lambda: None).landed
                reader.close()
                code = 0 if landed == 4 and all((arena[i] == i + 1).all() for i in range(4)) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the other user's reader did not serve every object whole"
        assert [path.stat().st_mtime_ns for path in paths] == [10**9] * 4
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_objects_the_verdict_takes_are_read_whole_however_their_flags_differ(tmp_path: Path) -> None:
    """Objects a writer with a secret tagged, loaded by a reader without one: the verdict takes them (an untagged
    reader checks no tag), so the native reads must not stop at them either: all three land, byte for byte,
    and are reported (a stop the verdict did not share once reported objects never read)."""
    from kvcached import native
    from kvcached.native import Side
    from kvcached.store.base import ObjectIdentity
    from kvcached.store.fileio import Reader, write_temporary
    from kvcached.store.landing import Targets

    if not native.available():
        pytest.skip("the native copy was not built here")
    writer = ObjectIdentity(digest=b"d" * 16, rank=0, payload=3 * 4096, secret=b"s" * 32)
    reader_identity = ObjectIdentity(digest=b"d" * 16, rank=0, payload=3 * 4096)
    keys = [bytes([i]) * 32 for i in range(3)]
    for i, key in enumerate(keys):
        record = np.full(writer.payload, i + 1, np.uint8)
        os.close(write_temporary(writer, tmp_path / str(i), key, [memoryview(record)]))
    arena = np.zeros((3, 3, 4096), dtype=np.uint8)
    reader = Reader(reader_identity)
    try:
        targets = Targets(Side.of([arena[:, p, :] for p in range(3)]), [0, 1, 2])
        outcome = reader.load(keys, [tmp_path / str(i) for i in range(3)], targets, lambda: None)
    finally:
        reader.close()
    assert (outcome.landed, outcome.why) == (3, None)
    assert all((arena[i] == i + 1).all() for i in range(3))


@pytest.mark.parametrize("kind", ["native", "python"])
def test_a_read_call_returns_once_its_time_is_spent(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader thread's call reads up to its limit of objects (four), but returns once its time is spent: a load
    of slow objects tells its progress object by object (the store's timeout is one without progress), of
    quick ones four objects a call."""
    from kvcached import native
    from kvcached.store import fileio

    if kind == "native" and not native.available():
        pytest.skip("the native copy was not built here")
    if kind == "python":
        monkeypatch.setattr(native, "_LIBRARY", None)
    identity, targets, arena, keys = reads_of(tmp_path, 9)
    monkeypatch.setattr(fileio, "READ_THREADS", 1)
    seen: dict[float, list[int]] = {}
    for budget in (0.0, 60.0):
        monkeypatch.setattr(fileio, "PROGRESS_S", budget)
        arena[:] = 0
        landed = seen[budget] = []  # at each progress mark: how many blocks hold their object already
        reader = fileio.Reader(identity)
        try:
            paths = [tmp_path / str(i) for i in range(9)]
            mark = lambda landed=landed: landed.append(int(arena[:, 0, 0].astype(bool).sum()))  # noqa: E731
            assert reader.load(keys, paths, targets, mark).landed == 9
        finally:
            reader.close()
    assert seen == {0.0: [1, 2, 3, 4, 5, 6, 7, 8, 9], 60.0: [4, 4, 4, 4, 8, 8, 8, 8, 9]}, seen
