"""FastDeploy's ready flags, kept in step with the rank records (``--ipc-suffix N``).

FastDeploy's engine and runners wait on ``IPCSignal`` arrays: a POSIX shm segment
``/dev/shm/<name>.<suffix>`` (``multiprocessing.shared_memory``), viewed as ``int32[ranks]``, plain stores.
With ``--ipc-suffix N`` the supervisor maintains two of them:

- ``cache_ready_signal.N[r]`` is 1 exactly while rank r is READY in this daemon's generation, else 0;
- ``swap_space_ready_signal.N[r]`` the same, for ranks that have a CPU swap pool.

A segment that exists is attached (the engine created it, or a killed run left it); otherwise it is
created with the daemon's object mode. Every rank's entry is written 0 before the first worker is forked,
so a 1 left by a killed run is gone before anything can be READY again. The engine may re-create a segment
at any time (``IPCSignal(create=True)`` unlinks and recreates): the supervisor looks at the inode on every
tick of its loop and writes the current values into the new one. At stop every entry becomes 0; segments
this run created are then unlinked, attached ones are left (zeroed) to their creator.

Rank workers killed with their supervisor cannot write 0; the next start does, before anything else.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Any

import numpy as np
import posix_ipc

from kvcached.access import Access
from kvcached.protocol.errors import SignalError
from kvcached.protocol.names import SHM_DIR

SIGNALS = ("cache_ready_signal", "swap_space_ready_signal")


class _Segment:
    def __init__(self, name: str, ranks: int, access: Access) -> None:
        self.name = name  # e.g. "cache_ready_signal.8021"
        self.path = SHM_DIR / name
        self.ranks = ranks
        self.access = access
        self.created = False
        self.inode = -1
        self.map: mmap.mmap | None = None
        self.values: np.ndarray[Any, Any] | None = None

    def open(self) -> None:
        """Attach, or create; raise ``SignalError`` for a segment too small or not ours to write."""
        self.close()
        posix = f"/{self.name}"
        size = 4 * self.ranks
        try:
            shm = posix_ipc.SharedMemory(posix)
            created = False
        except posix_ipc.ExistentialError:
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
            self.map = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        self.values = np.frombuffer(self.map, dtype=np.int32, count=self.ranks)
        self.inode = st.st_ino
        self.created = created  # a segment re-created by the engine is the engine's, not ours to unlink

    def replaced(self) -> bool:
        """True if the name now refers to another segment than ours (or to none)."""
        try:
            return os.stat(self.path).st_ino != self.inode
        except FileNotFoundError:
            return True

    def write(self, flags: list[bool]) -> None:
        assert self.values is not None
        for rank, flag in enumerate(flags):
            value = 1 if flag else 0
            if self.values[rank] != value:
                self.values[rank] = value

    def close(self) -> None:
        self.values = None
        if self.map is not None:
            self.map.close()
            self.map = None


class FastDeploySignals:
    """The two flag arrays of one instance. Methods raise ``SignalError`` with a clear message."""

    def __init__(self, suffix: int, ranks: int, access: Access) -> None:
        self.segments = [_Segment(f"{name}.{suffix}", ranks, access) for name in SIGNALS]
        self.ranks = ranks
        self.cache = [False] * ranks
        self.swap = [False] * ranks

    def open(self) -> None:
        """Attach or create both, and write 0 for every rank."""
        for segment in self.segments:
            segment.open()
        self._write()

    def update(self, ready: list[bool], has_pool: bool) -> None:
        """New values: ``ready[r]`` is rank r READY in this generation."""
        self.cache = list(ready)
        self.swap = [flag and has_pool for flag in ready]
        self._write()

    def tick(self) -> None:
        """Follow a segment the engine re-created, writing the current values into it."""
        for segment in self.segments:
            if segment.replaced():
                segment.open()
        self._write()

    def _write(self) -> None:
        cache, swap = self.segments
        cache.write(self.cache)
        swap.write(self.swap)

    def close(self) -> None:
        """0 for every rank (in a segment the engine re-created too); unlink what this run created."""
        self.cache = self.swap = [False] * self.ranks
        for segment in self.segments:
            with contextlib.suppress(SignalError, posix_ipc.Error, OSError):
                if segment.values is None or segment.replaced():
                    segment.open()
                segment.write([False] * self.ranks)
            segment.close()
            if segment.created and not segment.replaced():
                with contextlib.suppress(posix_ipc.ExistentialError):
                    posix_ipc.unlink_shared_memory(f"/{segment.name}")
