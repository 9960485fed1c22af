"""Where a load puts block records, and the one pass that lands each record and takes its checksum.

A load is handed ``Targets``: record ``i`` goes to block ``ids[i]`` of a side (``kvcached.native.Side``: the device
tier's pieces, or rows of a staging buffer), piece by piece in record order. A backend lands an object's payload there
and takes its XXH3-64 in the same pass, never in a pass of its own:

* ``land`` copies payloads that are in memory (a Mooncake segment, a fetched batch) into their targets' pieces, hashing
  each stripe from the registers it was stored from (``kvcached/_verify.c``), so the checksum is that of the bytes
  written even if the source changes meanwhile;
* ``read_into`` reads a payload from a file a request at a time into a small reused buffer (which stays in the CPU's
  cache) and lands each request from there in the target's pieces, hashed on the way;
* ``gather`` is the other way, for a store: a block's pieces into one buffer, checksum on the way.

Without the native routines (not built, ``KVCACHED_NATIVE_COPY=0``, or a payload of 240 bytes or less) the same is done
piece by piece with numpy and ``xxhash``, each piece hashed right after it is moved."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from kvcached import native
from kvcached.native import Side

Array = np.ndarray[Any, Any]


class Targets:
    """Where a load lands its records: record ``i`` in block ``ids[i]`` of ``side``."""

    __slots__ = ("_strides", "ids", "side")

    def __init__(self, side: Side, ids: Sequence[int]) -> None:
        self.side = side
        self.ids = ids
        self._strides = side.strides.astype(np.uint64)

    def __len__(self) -> int:
        return len(self.ids)

    def addresses(self, i: int) -> Array:
        """Where each piece of record ``i`` goes (uint64 addresses, in record order)."""
        addresses: Array = self.side.bases + np.uint64(self.ids[i]) * self._strides
        return addresses

    def views(self, i: int) -> list[memoryview]:
        """Record ``i``'s pieces as writable views, in record order."""
        block = self.ids[i]
        return [memoryview(view[block]) for view in self.side.views]


def _address(data: memoryview) -> int:
    address: int = np.frombuffer(data, dtype=np.uint8).ctypes.data
    return address


def land(
    targets: Targets, indices: Sequence[int], payloads: Sequence[memoryview], addresses: Sequence[int] | None = None
) -> list[int]:
    """Copy payload ``k`` (a whole record; at ``addresses[k]`` when the caller knows it) into target ``indices[k]``, for
    every ``k``; the XXH3-64 of the bytes written into each (one native call for them all)."""
    if payloads and native.hashes(len(payloads[0])):
        found = addresses if addresses is not None else [_address(payload) for payload in payloads]
        sources = np.array(found, dtype=np.uint64)
        ids = np.array([targets.ids[i] for i in indices], dtype=np.int64)
        digests: list[int] = native.land_blocks(sources, targets.side, ids).tolist()
        return digests
    return [_land_slowly(targets, i, payload) for i, payload in zip(indices, payloads, strict=True)]


def _land_slowly(targets: Targets, i: int, payload: memoryview) -> int:
    digest = xxhash.xxh3_64()
    offset = 0
    for view in targets.views(i):
        view[:] = payload[offset : offset + len(view)]
        digest.update(view)
        offset += len(view)
    return digest.intdigest()


def gather(pieces: Sequence[memoryview], into: memoryview) -> int:
    """Copy ``pieces`` one after the other into ``into`` (as long as they are together); their XXH3-64."""
    views = [np.frombuffer(piece, dtype=np.uint8) for piece in pieces]
    if native.hashes(len(into)):
        addresses = np.array([view.ctypes.data for view in views], dtype=np.uint64)
        widths = np.array([view.size for view in views], dtype=np.int64)
        return native.gather_hash(addresses, widths, _address(into))
    digest = xxhash.xxh3_64()
    offset = 0
    for piece, view in zip(pieces, views, strict=True):
        into[offset : offset + view.size] = piece.cast("B") if piece.format != "B" else piece
        digest.update(into[offset : offset + view.size])
        offset += view.size
    return digest.intdigest()


def read_into(fd: int, offset: int, targets: Targets, i: int, bounce: memoryview) -> tuple[int, int | None]:
    """Read a payload from ``fd`` at ``offset`` into target ``i``, ``len(bounce)`` bytes at a time through ``bounce``:
    (bytes read, XXH3-64 of the payload when all of it was read). Raises ``OSError`` when a read fails."""
    total = int(targets.side.widths.sum())
    if native.hashes(total):
        return native.read_land(
            fd, offset, targets.addresses(i), targets.side.widths, bounce=_address(bounce), chunk=len(bounce)
        )
    digest = xxhash.xxh3_64()
    done = 0
    for view in targets.views(i):
        at = 0
        while at < len(view):
            got = os.preadv(fd, [view[at : at + len(bounce)]], offset + done)
            if got <= 0:
                return done, None
            digest.update(view[at : at + got])
            at += got
            done += got
    return done, digest.intdigest()
