"""The ``host`` device backend: a rank's device tier is one POSIX shm arena (``memory.shm``), laid out by
``kvcached.protocol.layout``; runners map the same object and view its tensors zero-copy, attaching with the descriptor
``{"arena": "/kvcached.<instance>.<id>.r<rank>.dev", "bytes": n}``. The arena outlives the worker that created it (a
named object): a replaced worker or an adopting daemon ``reopen``s it, bytes untouched."""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import threading
from collections.abc import Mapping
from typing import Any

import numpy as np
import posix_ipc

from kvcached.memory import register, shm
from kvcached.memory.base import Array, Attached, DeviceBackend, DeviceTier, Piece, Progress, TierRequest
from kvcached.protocol.errors import AccessDenied, InvalidArgument, ProtocolError, ResourceError
from kvcached.protocol.layout import device_arena_bytes, device_slots, device_views
from kvcached.protocol.names import shm_path
from kvcached.protocol.spec import CacheSpec
from kvcached.protocol.trust import admitted


@dataclasses.dataclass(frozen=True, slots=True)
class HostPiece:
    """A tensor of the ``host`` backend: a numpy view ``[num_blocks, nbytes]`` of the device arena."""

    device: Array
    column: int
    nbytes: int

    def read(self, start: int, count: int) -> Array:
        return self.device[start : start + count]

    def write(self, start: int, rows: Array) -> None:
        self.device[start : start + len(rows)] = rows

    def host(self) -> Array:
        return self.device


def host_pieces(spec: CacheSpec, device: Any) -> list[HostPiece]:
    """The pieces of a device arena (any buffer laid out by ``device_slots``)."""
    device_u8 = np.frombuffer(device, dtype=np.uint8)
    pieces = []
    column = 0
    for slot in device_slots(spec):
        rows = slot.shape[0]  # num_blocks, or mtp_blocks for an MTP layer
        width = slot.nbytes // rows
        view = device_u8[slot.offset : slot.offset + slot.nbytes].reshape(rows, width)
        pieces.append(HostPiece(view, column, width))
        column += width
    return pieces


class HostTier(DeviceTier):
    """A mapped device arena."""

    def __init__(self, spec: CacheSpec, name: str, mapping: mmap.mmap, *, populated: bool = True) -> None:
        self.mapping = mapping
        self.populated = populated
        self.nbytes = len(mapping)
        self.descriptor = {"arena": name, "bytes": self.nbytes}
        self.pieces: list[Piece] = list(host_pieces(spec, mapping))

    def close(self) -> None:
        self.pieces = []
        with contextlib.suppress(BufferError):  # a view still alive elsewhere: unmapped with it
            self.mapping.close()

    def warm(self) -> threading.Thread | None:
        if self.populated:
            return None
        self.populated = True
        return shm.prefault(self.mapping)


class HostAttached(Attached):
    """A runner's mapping of a device arena and its per-layer views."""

    def __init__(self, spec: CacheSpec, mapping: mmap.mmap, framework: str) -> None:
        self.mapping: mmap.mmap | None = mapping
        self.nbytes = len(mapping)
        views = device_views(spec, mapping)
        if framework == "paddle":
            self.tensors = {
                kind: [to_paddle(v, spec.dtype if kind in ("key", "value") else spec.scale_dtype) for v in arrays]
                for kind, arrays in views.items()
            }
        else:
            self.tensors = views

    def close(self) -> None:
        self.tensors = {kind: [] for kind in self.tensors}
        if self.mapping is not None:
            mapping, self.mapping = self.mapping, None
            self.nbytes = 0
            with contextlib.suppress(BufferError):  # a caller still holds a view: unmapped with it
                mapping.close()


def private_attached(spec: CacheSpec, framework: str) -> HostAttached:
    """Anonymous private memory of a device arena's size, viewed as ``framework`` tensors."""
    mapping = mmap.mmap(-1, device_arena_bytes(spec), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return HostAttached(spec, mapping, framework)


def to_paddle(array: Array, dtype: str) -> Any:
    """A paddle tensor aliasing numpy ``array`` (zero-copy through DLPack) with the cache's ``dtype``."""
    import paddle

    if dtype == "bfloat16":
        # numpy has no bfloat16: hand the raw bits over as int16, then reinterpret in place.
        return paddle.from_dlpack(array.view(np.int16)).view(paddle.bfloat16)
    return paddle.from_dlpack(array)


class HostBackend(DeviceBackend):
    name = "host"
    outlives_worker = True

    def shm_bytes(self, spec: CacheSpec) -> int:
        return device_arena_bytes(spec)

    def create(self, request: TierRequest, progress: Progress) -> DeviceTier:
        name, size = request.shm_name("dev"), device_arena_bytes(request.spec)
        try:
            mapping = shm.create_arena(
                name, size, progress, mode=request.mode, gid=request.gid, huge=request.huge_pages
            )
        except posix_ipc.ExistentialError:
            raise ResourceError(f"arena name taken by another process: {name}") from None
        return HostTier(request.spec, name, mapping, populated=False)

    def reopen(self, request: TierRequest, descriptor: Mapping[str, Any]) -> DeviceTier:
        name = str(descriptor.get("arena", ""))
        if name != request.shm_name("dev"):
            raise ResourceError(f"descriptor names arena {name!r}, expected {request.shm_name('dev')!r}")
        try:
            mapping = shm.open_arena(name, device_arena_bytes(request.spec), populate=False)
        except (posix_ipc.Error, ProtocolError) as exc:
            raise ResourceError(f"cannot reopen device arena {name}: {exc}") from None
        return HostTier(request.spec, name, mapping, populated=False)

    def why_not_adoptable(self, request: TierRequest, descriptor: Mapping[str, Any]) -> str | None:
        name = descriptor.get("arena")
        if name != request.shm_name("dev"):
            return f"rank {request.rank}'s record names arena {name!r}, expected {request.shm_name('dev')!r}"
        return shm.why_not_ours(name, device_arena_bytes(request.spec))

    def attach(
        self, spec: CacheSpec, descriptor: Mapping[str, Any], local_rank: int, framework: str, *, owner: int
    ) -> Attached:
        name, size = descriptor.get("arena"), descriptor.get("bytes")
        if not isinstance(name, str) or not isinstance(size, int):
            raise ProtocolError(f"rank {local_rank}: host descriptor {dict(descriptor)} lacks arena and bytes")
        expected = device_arena_bytes(spec)
        if size != expected:
            raise ProtocolError(f"rank {local_rank}: arena {name} has {size} bytes, the runner's layout {expected}")
        if framework not in ("numpy", "paddle"):
            raise InvalidArgument("framework", f"must be numpy or paddle, got {framework!r}")
        try:
            mapping = shm.open_arena(name, size, populate=False, owner=owner)
        except posix_ipc.ExistentialError:
            raise ProtocolError(f"rank {local_rank}: published arena {name} does not exist") from None
        except posix_ipc.PermissionsError:
            raise AccessDenied(f"{shm_path(name)}: permission denied: {admitted(shm_path(name))}") from None
        return HostAttached(spec, mapping, framework)


register(HostBackend())
