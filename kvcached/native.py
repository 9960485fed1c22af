"""The native block copy (``kvcached/_copy.c``) and copy-and-checksum (``_verify.c``), loaded with ctypes if built.

``copy_blocks`` moves every piece of every block of a task in one call, with the GIL released (ctypes releases it around
a foreign call). ``land_blocks``, ``gather_hash`` and ``read_land`` move store objects' payloads (from memory into
blocks, from a block's pieces into a buffer, from a file into a block) and take each one's XXH3-64 in the same pass.
``available()`` says whether it was built; without it the copy engine (``kvcached.copy_engine``) copies with numpy, one
slice per piece and run of ids, and the store lands and hashes in steps of its own (``kvcached.store.landing``).
``KVCACHED_NATIVE_COPY=0`` turns it off (to compare, or to rule it out).
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.machinery
import os
from pathlib import Path
from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Side:
    """One host buffer seen as pieces: piece ``p`` of block ``b`` is ``views[p][b]``, ``widths[p]`` bytes at
    ``bases[p] + b * strides[p]``. Holds the views, so the memory stays mapped while the side exists."""

    views: tuple[Array, ...]
    bases: Array  # uint64
    strides: Array  # int64
    widths: Array  # int64

    @classmethod
    def of(cls, views: list[Array]) -> Side:
        """The side of ``views``: a uint8 ``[blocks, width]`` array per piece, rows of any stride, each contiguous."""
        for view in views:
            if view.ndim != 2 or view.dtype != np.uint8 or (view.shape[1] > 1 and view.strides[1] != 1):
                raise ValueError("a piece must be a uint8 [blocks, width] view with contiguous rows")
        return cls(
            tuple(views),
            np.array([view.ctypes.data for view in views], dtype=np.uint64),
            np.array([view.strides[0] for view in views], dtype=np.int64),
            np.array([view.shape[1] for view in views], dtype=np.int64),
        )


def _declare(function: Any, restype: Any, *argtypes: Any) -> None:
    function.restype = restype
    function.argtypes = argtypes


class _Library:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        _declare(self.lib.kv_copy_blocks, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, i32)
        _declare(self.lib.kv_streams, i32)
        _declare(self.lib.kv_gather_hash, ctypes.c_uint64, i64, ptr, ptr, ptr)
        _declare(self.lib.kv_read_land, i64, i32, i64, i64, ptr, ptr, ptr, i64, ptr)
        _declare(self.lib.kv_land_blocks, None, i64, ptr, i64, ptr, ptr, ptr, ptr, ptr)
        reads = (i64, ptr, i64, i64, ptr, i64, ptr, ptr, i64, *[ptr] * 5, i64, ptr, ptr, i64, i64, *[ptr] * 4)
        _declare(self.lib.kv_read_objects, i64, *reads)
        _declare(self.lib.kv_hash_min_bytes, i64)
        self.streams = bool(self.lib.kv_streams())
        self.hash_min_bytes = int(self.lib.kv_hash_min_bytes())


def _load() -> _Library | None:
    if os.environ.get("KVCACHED_NATIVE_COPY", "1") == "0":
        return None
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"_copy{suffix}"
        if path.is_file():
            try:
                return _Library(path)
            except (OSError, AttributeError):  # unloadable, or built from older sources: rebuild it
                return None
    return None


_LIBRARY = _load()


def available() -> bool:
    """Whether the native copy was built and loads."""
    return _LIBRARY is not None


def describe() -> str:
    """What the copy engine uses, for ``doctor`` and the log."""
    if _LIBRARY is None:
        off = os.environ.get("KVCACHED_NATIVE_COPY") == "0"
        return "numpy slices (KVCACHED_NATIVE_COPY=0)" if off else "numpy slices (the native copy was not built)"
    stores = "non-temporal stores" if _LIBRARY.streams else "memcpy"
    return f"native ({_LIBRARY.path.name}, {stores})"


def copy_blocks(src: Side, dst: Side, src_ids: Array, dst_ids: Array) -> int:
    """Copy every piece of block ``src_ids[i]`` of ``src`` to block ``dst_ids[i]`` of ``dst``; bytes moved.
    Ids must be checked (in range, targets unique) by the caller; both sides have the same widths."""
    assert _LIBRARY is not None
    src_ids = np.ascontiguousarray(src_ids, dtype=np.int64)
    dst_ids = np.ascontiguousarray(dst_ids, dtype=np.int64)
    assert len(src_ids) == len(dst_ids) and len(src.widths) == len(dst.widths)
    moved: int = _LIBRARY.lib.kv_copy_blocks(
        len(src.widths),
        src.bases.ctypes.data,
        src.strides.ctypes.data,
        dst.bases.ctypes.data,
        dst.strides.ctypes.data,
        src.widths.ctypes.data,
        len(src_ids),
        src_ids.ctypes.data,
        dst_ids.ctypes.data,
        1,
    )
    return moved


def hashes(nbytes: int) -> bool:
    """Whether ``land_blocks``, ``gather_hash`` and ``read_land`` take payloads of ``nbytes`` (built, long enough)."""
    return _LIBRARY is not None and nbytes >= _LIBRARY.hash_min_bytes


def gather_hash(addresses: Array, widths: Array, flat: int) -> int:
    """Copy the pieces (piece ``p``: ``widths[p]`` bytes at ``addresses[p]``) one after the other to address
    ``flat``; the XXH3-64 of the bytes copied. Only where ``hashes(widths.sum())``."""
    assert _LIBRARY is not None
    digest: int = _LIBRARY.lib.kv_gather_hash(len(widths), addresses.ctypes.data, widths.ctypes.data, flat)
    return digest


def land_blocks(sources: Array, side: Side, ids: Array) -> Array:
    """Copy payload ``i`` (contiguous at address ``sources[i]``) into block ``ids[i]`` of ``side``, non-temporal stores,
    one call; each payload's XXH3-64 (uint64). Only where ``hashes(side.widths.sum())``; ids checked by the caller."""
    assert _LIBRARY is not None
    sources = np.ascontiguousarray(sources, dtype=np.uint64)
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    digests = np.zeros(len(ids), dtype=np.uint64)
    _LIBRARY.lib.kv_land_blocks(
        len(ids),
        sources.ctypes.data,
        len(side.widths),
        side.bases.ctypes.data,
        side.strides.ctypes.data,
        side.widths.ctypes.data,
        ids.ctypes.data,
        digests.ctypes.data,
    )
    return digests


def read_land(
    fd: int, offset: int, addresses: Array, widths: Array, *, bounce: int, chunk: int
) -> tuple[int, int | None]:
    """Read the pieces' bytes (piece ``p``: ``widths[p]`` bytes at ``addresses[p]``) from ``fd`` at ``offset``,
    ``chunk`` bytes at a time into the buffer at address ``bounce``, each landed from there in the pieces and hashed as
    soon as it arrives: (bytes read, XXH3-64 when every byte was read). Raises ``OSError`` for a failed read."""
    assert _LIBRARY is not None
    digest = ctypes.c_uint64()
    got: int = _LIBRARY.lib.kv_read_land(
        fd, offset, len(widths), addresses.ctypes.data, widths.ctypes.data, bounce, chunk, ctypes.byref(digest)
    )
    if got < 0:
        raise OSError(-got, os.strerror(-got))
    return got, digest.value if got == int(widths.sum()) else None


#: ``ObjectReads.read``'s outcomes other than bytes read or -errno.
NOT_REGULAR, WRONG_SIZE = -(1 << 40), -(1 << 40) - 1


class ObjectReads:
    """One load's objects, read by ``take`` from several threads at once (``kv_read_objects``): object ``i``
    at ``paths[i]`` (``size`` bytes: ``header_len`` of header, then the payload) into block ``ids[i]`` of
    ``side``; ``expect``: the first 88 bytes of every header (its key and checksum zero), ``keys`` the objects'
    32-byte keys one after the other. Once every ``take`` returned, ``read(i)`` says what reading object ``i``
    gave for every ``i`` up to ``stop`` (below the count); none past it was read."""

    def __init__(
        self, paths: list[bytes], *, size: int, header_len: int, expect: bytes, keys: bytes, side: Side, ids: Array
    ) -> None:
        count = len(paths)
        self.size, self.header_len, self.side = size, header_len, side  # (the side: its arrays stay mapped)
        stride = max(map(len, paths)) + 1
        self.paths = b"".join(path.ljust(stride, b"\0") for path in paths)  # path i at i * stride, NUL-ended
        self.ids = np.ascontiguousarray(ids, dtype=np.int64)
        self.headers = np.zeros((count, header_len), dtype=np.uint8)
        # what reading each object gave (got, found, digest: a row each; its times before: two rows, interleaved),
        # then the next index to take and ``stop``
        self.results = np.zeros(5 * count + 2, dtype=np.int64)
        self.results[-1] = count
        at = self.results.ctypes.data
        # kv_read_objects's arguments but the buffer and the limits: the objects, where they land, the shared
        # pair, what reading them gave
        self._objects = (count, self.paths, stride, size, self.headers.ctypes.data, header_len, expect, keys)
        widths, bases, strides = side.widths.ctypes.data, side.bases.ctypes.data, side.strides.ctypes.data
        self._pieces = (len(side.widths), bases, strides, widths, self.ids.ctypes.data)
        self._shared = (at + 40 * count, at + 40 * count + 8)
        self._results = (at, at + 8 * count, at + 16 * count, at + 24 * count)

    @property
    def stop(self) -> int:
        """The lowest index not read whole or whose header is not its object's (``kv_read_objects``), else the count."""
        return int(self.results[-1])

    def take(self, bounce: memoryview, limit: int, budget_s: float) -> int:
        """Read up to ``limit`` of the objects not taken yet (fewer once ``budget_s`` is spent), through ``bounce``, the
        interpreter's lock let go throughout; how many this call read. Only where ``hashes(side.widths.sum())``."""
        assert _LIBRARY is not None
        at = np.frombuffer(bounce, dtype=np.uint8).ctypes.data
        budget = int(budget_s * 1e9)
        objects, pieces, shared, results = self._objects, self._pieces, self._shared, self._results
        taken: int = _LIBRARY.lib.kv_read_objects(*objects, *pieces, at, len(bounce), *shared, limit, budget, *results)
        if taken < 0:
            raise MemoryError("no memory for a load's piece addresses")
        return taken

    def read(self, i: int) -> tuple[int, int, bytes, int | None]:
        """What reading object ``i`` gave (``kvcached.store.fileio.Read``)."""
        got, found, digest = self.results[i : 3 * len(self.headers) : len(self.headers)].tolist()
        whole = got == self.size - self.header_len
        return got, found, self.headers[i].tobytes(), digest % (1 << 64) if whole else None

    def before(self, i: int) -> tuple[int, int] | None:
        """The access and modification times (ns) object ``i`` had before it was read whole and its times set to
        now; None if it was not read whole (its times untouched)."""
        if self.results[i] != self.size - self.header_len:
            return None
        at = 3 * len(self.headers) + 2 * i
        access, modification = self.results[at : at + 2].tolist()
        return access, modification
