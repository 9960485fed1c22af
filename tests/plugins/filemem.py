"""A device backend that exists only in the tests: each rank's device tier is a regular file, mapped.

It shows the seam: one module and one registration (the last line) make ``--memory testfile`` work for a
daemon and its runners alike, when both have ``KVCACHED_PLUGINS=tests.plugins.filemem`` and
``KVCACHED_TEST_FILEMEM_DIR`` (where the files go) in their environment.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvcached import memory
from kvcached.memory.base import Attached, DeviceBackend, DeviceTier, Progress, TierRequest
from kvcached.memory.host import HostAttached, host_pieces
from kvcached.protocol.errors import ProtocolError, ResourceError
from kvcached.protocol.layout import device_arena_bytes
from kvcached.protocol.spec import CacheSpec


def _path(request: TierRequest) -> Path:
    directory = Path(os.environ["KVCACHED_TEST_FILEMEM_DIR"])
    return directory / f"{request.instance}.{request.arena_id:016x}.r{request.rank}.dev"


def _map(path: Path, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


class FileTier(DeviceTier):
    def __init__(self, spec: CacheSpec, path: Path, mapping: mmap.mmap) -> None:
        self.mapping = mapping
        self.nbytes = len(mapping)
        self.descriptor = {"path": str(path), "bytes": self.nbytes}
        self.pieces = list(host_pieces(spec, mapping))

    def close(self) -> None:
        self.pieces = []
        with contextlib.suppress(BufferError):
            self.mapping.close()


class FileBackend(DeviceBackend):
    name = "testfile"
    outlives_worker = True

    def create(self, request: TierRequest, progress: Progress) -> DeviceTier:
        path, size = _path(request), device_arena_bytes(request.spec)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise ResourceError(f"{path} exists") from None
        try:
            os.posix_fallocate(fd, 0, size)
        finally:
            os.close(fd)
        progress(size)
        return FileTier(request.spec, path, _map(path, size))

    def reopen(self, request: TierRequest, descriptor: Mapping[str, Any]) -> DeviceTier:
        path = Path(str(descriptor["path"]))
        return FileTier(request.spec, path, _map(path, device_arena_bytes(request.spec)))

    def release(self, request: TierRequest) -> None:
        _path(request).unlink(missing_ok=True)

    def attach(
        self, spec: CacheSpec, descriptor: Mapping[str, Any], local_rank: int, framework: str, *, owner: int
    ) -> Attached:
        path = Path(str(descriptor.get("path")))
        if not path.is_file():
            raise ProtocolError(f"rank {local_rank}: {path} does not exist")
        return HostAttached(spec, _map(path, int(descriptor["bytes"])), framework)


memory.register(FileBackend())
