"""A rank's key directory: which CPU pool block holds the block of which key, kept in shared memory so
that it outlives the worker and the daemon with the pool it describes.

::

    /kvcached.<instance>.<arena id>.r<rank>.keys     (mode as the pool's, created with it)
    +-------------------------------------------------------------------------------+
    | 0 magic "KVKEYDIR" | 8 version u32 | 12 slots u32 | 16 key size u32 | 20..64 0  |
    | slot of CPU block 0: 0 state u64 (0 empty, 1 valid) | 8 key 32B              |
    | slot of CPU block 1 ... slot of CPU block num_cpu_blocks-1                    |
    +-------------------------------------------------------------------------------+

The worker of the rank is its only writer. Invariant: a valid slot's key names the bytes its CPU block holds. The worker
keeps it by the order of its writes: before a copy into CPU block ``c`` it empties slot ``c`` (one aligned 8-byte
store); after the copy completed it writes the key, then makes the slot valid. A worker killed mid-copy leaves the slot
empty, so a slot is never valid for half-written bytes, whatever point the process died at (its stores to a shared
mapping are in the page cache once made). A CPU block overwritten without a key (a plain ``swap_out``) leaves the
directory first. The worker's index (key -> CPU blocks) is built from the slots when it starts: a replaced worker and an
adopting daemon read what the last one wrote.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable, Sequence

import numpy as np

from kvcached.memory.shm import create_arena, open_arena
from kvcached.protocol.errors import ProtocolError
from kvcached.protocol.layout import round_up
from kvcached.protocol.messages import KEY_BYTES

MAGIC = b"KVKEYDIR"
VERSION = 1
HEADER_BYTES = 64
SLOT_BYTES = 8 + KEY_BYTES
_HEADER = struct.Struct("<8sIII")
EMPTY, VALID = 0, 1


def directory_bytes(num_cpu_blocks: int) -> int:
    """Bytes of the key directory of a pool of ``num_cpu_blocks`` blocks (page-rounded)."""
    return round_up(HEADER_BYTES + SLOT_BYTES * num_cpu_blocks)


class KeyDirectory:
    """One rank's key directory, mapped (for the worker's life: its views hold the mapping). ``create`` (a
    new pool) or ``open`` (a pool that exists)."""

    def __init__(self, mapping: mmap.mmap, slots: int) -> None:
        table = np.frombuffer(mapping, dtype=np.uint8, count=SLOT_BYTES * slots, offset=HEADER_BYTES)
        self._table = table.reshape(slots, SLOT_BYTES)
        self._state = self._table[:, :8].view("<u8")[:, 0]  # each slot's first 8 bytes, one aligned word
        self._where: dict[bytes, set[int]] = {}
        self._key_of: dict[int, bytes] = {}
        for block in np.flatnonzero(self._state == VALID).tolist():
            key = self._table[block, 8:].tobytes()
            self._where.setdefault(key, set()).add(block)
            self._key_of[block] = key

    @classmethod
    def create(cls, name: str, slots: int, *, mode: int, gid: int | None) -> KeyDirectory:
        """A new, empty directory. Raises what ``create_arena`` raises."""
        mapping = create_arena(name, directory_bytes(slots), mode=mode, gid=gid)
        _HEADER.pack_into(mapping, 0, MAGIC, VERSION, slots, KEY_BYTES)
        return cls(mapping, slots)

    @classmethod
    def open(cls, name: str, slots: int) -> KeyDirectory:
        """The directory a worker of an earlier generation (or this one) left. Raises ``ProtocolError`` when it is not
        one of ``slots`` slots, ``posix_ipc.ExistentialError`` when absent, ``NotTrusted`` when not this user's."""
        mapping = open_arena(name, directory_bytes(slots), owner=os.geteuid())
        magic, version, found, key_bytes = _HEADER.unpack_from(mapping, 0)
        if (magic, version, found, key_bytes) != (MAGIC, VERSION, slots, KEY_BYTES):
            mapping.close()
            raise ProtocolError(
                f"{name}: not a key directory of {slots} slots (magic {magic!r}, version {version}, {found} slots)"
            )
        return cls(mapping, slots)

    def __len__(self) -> int:
        return len(self._key_of)

    def find(self, key: bytes) -> int | None:
        blocks = self._where.get(key)
        return min(blocks) if blocks else None

    def forget(self, blocks: Iterable[int]) -> None:
        """Empty the slots of ``blocks`` (before they are overwritten)."""
        for block in blocks:
            key = self._key_of.pop(block, None)
            if key is None:
                continue
            self._state[block] = EMPTY
            holders = self._where[key]
            holders.discard(block)
            if not holders:
                del self._where[key]

    def publish(self, blocks: Sequence[int], keys: Sequence[bytes]) -> None:
        """Enter ``keys[i]`` for CPU block ``blocks[i]``, whose copy has completed (slots emptied before it)."""
        for block, key in zip(blocks, keys, strict=True):
            self.forget((block,))
            self._table[block, 8:] = np.frombuffer(key, dtype=np.uint8)
            self._state[block] = VALID
            self._key_of[block] = key
            self._where.setdefault(key, set()).add(block)
