"""What a dead run of an instance left behind, and removing it (``kvcached start`` before it allocates, ``kvcached
doctor [--clean]``, the tests). An entry under the instance's names is a leftover only when no live daemon owns the
instance; one that is not ours (another owner, foreign permissions, not a plain file) is a squatter, never used or
deleted: a start reports it and goes on (at the control block's name it refuses, with what to do)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import stat
from pathlib import Path

import posix_ipc

from kvcached import memory
from kvcached.memory.shm import OUR_MODES
from kvcached.protocol.errors import KVCacheError
from kvcached.protocol.instance import read_instance
from kvcached.protocol.names import instance_lock_path, instance_shm_entries, posix_name
from kvcached.protocol.spec import CacheSpec


@dataclasses.dataclass(slots=True)
class Leftovers:
    """What an instance has in /dev/shm and its run directory, as found by ``inspect_instance``."""

    entries: list[Path]
    sockets: list[Path]
    #: Files a device backend made outside the instance's names (the xpu backend's set_data_ipc records).
    files: list[Path]
    #: Each object under our names that is not ours (foreign owner or mode), with why: never touched.
    squatters: list[tuple[Path, str]]
    #: The daemon of a published control block, if it is alive (then nothing here is a leftover).
    live_pid: int | None
    #: The host-wide instance lock in /dev/shm, when it exists (taken, and removed, by whoever cleans).
    lock: Path | None = None

    @property
    def left(self) -> list[Path]:
        """Everything of the instance found, as `kvcached stop`, `doctor` and `doctor --clean` count a dead run's
        leftovers alike: entries, sockets, files and the instance lock."""
        return self.entries + self.sockets + self.files + ([self.lock] if self.lock is not None else [])


def squatter(path: Path, st: os.stat_result) -> str | None:
    """Why ``path`` (an entry under our names) is not ours, or None if it is."""
    me = os.geteuid()
    if st.st_uid == me and stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) in OUR_MODES:
        return None
    return (
        f"{path} is not ours (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}; kvcached makes uid {me}, "
        "mode 600, 640 or 660): refusing to use or delete it. Remove it if it is stale, or pick another --instance "
        "name."
    )


def live_daemon(instance: str) -> int | None:
    """The pid of the live daemon of ``instance``'s published control block, or None (no block, a dead daemon's, one
    that is not ours, or this very process's before a restart's exec: none of these is alive)."""
    try:
        found = read_instance(instance)
    except KVCacheError:
        return None
    if found is None or found.header.daemon_pid == os.getpid():
        return None
    return found.header.daemon_pid


def inspect_instance(instance: str, run_dir: Path) -> Leftovers:
    """The objects of ``instance`` (any generation) and whether a live daemon owns them. The host-wide instance lock is
    not among them: it is taken, and removed, by whoever holds it."""
    lock = instance_lock_path(instance)
    every = instance_shm_entries(instance)
    entries = [entry for entry in every if entry != lock]
    squatters = [(entry, why) for entry in entries if (why := squatter(entry, entry.lstat())) is not None]
    try:  # its task sockets, and what it did with restart signals (``handover.refusal_path``)
        sockets = sorted(run_dir.glob(f"{instance}.r*.sock")) if run_dir.is_dir() else []
        sockets += [path for path in [run_dir / f"{instance}.restart"] if path.exists()]
    except PermissionError:  # another user's run directory (doctor run by someone else): none seen
        sockets = []
    live = live_daemon(instance)
    files = [] if live is not None else backend_files(instance)
    return Leftovers(entries, sockets, files, squatters, live, lock if lock in every else None)


def backend_files(instance: str) -> list[Path]:
    """Files the device backend of a dead run made outside the instance's names, as its records tell (the control block
    of a dead run stays until the next start reclaims it); only those owned by this user."""
    try:
        published = read_instance(instance, None, live=False)
        spec = CacheSpec.from_dict(published.header.spec) if published is not None else None
    except KVCacheError:
        return []
    if published is None or spec is None:
        return []
    found: list[Path] = []
    for record in published.records.values():
        try:
            backend = memory.get(record.backend) if record.backend else None
        except KVCacheError:
            continue
        if backend is not None:
            found += backend.leftovers(spec, record.descriptor)
    return [path for path in found if path.exists() and path.lstat().st_uid == os.geteuid()]


def unlink_entries(entries: list[Path]) -> None:
    for entry in entries:
        name, is_sem = posix_name(entry)
        with contextlib.suppress(posix_ipc.ExistentialError):
            if is_sem:
                posix_ipc.unlink_semaphore(name)
            else:
                posix_ipc.unlink_shared_memory(name)


def remove_leftovers(found: Leftovers, keep: set[Path] | frozenset[Path] = frozenset()) -> int:
    """Unlink what ``inspect_instance`` found (never with a live daemon), except squatters and ``keep`` (the memory a
    start adopts, the sockets its last image's workers still serve on); how many."""
    assert found.live_pid is None
    spared = keep | {path for path, _ in found.squatters}
    entries = [entry for entry in found.entries if entry not in spared]
    unlink_entries(entries)
    files = [path for path in found.sockets + found.files if path not in spared]
    for path in files:
        path.unlink(missing_ok=True)
    return len(entries) + len(files)
