"""The keeper's memory: where a memfd is mapped, an mmap's address, page tables filled ahead, and the
spans an agent's request names, checked to lie inside its buffer before a pointer is made of them."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Any, TypeGuard


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def spans(base: int, length: int, count: int, offsets: Any, sizes: Any) -> tuple[list[int], list[int]]:
    """Pointers and sizes of ``count`` objects at ``offsets`` in a buffer of ``length`` bytes at ``base``:
    each span must lie whole inside the buffer. Raises ``ValueError`` naming the first that does not."""
    for field, values in (("offsets", offsets), ("sizes", sizes)):
        if not isinstance(values, list) or len(values) != count or not all(map(is_int, values)):
            raise ValueError(f"{field}: must be a list of {count} whole numbers, one per name")
    for i, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        if offset < 0 or size <= 0 or offset + size > length:
            raise ValueError(f"object {i}: {size} bytes at offset {offset} do not lie in the {length}-byte buffer")
    return [base + offset for offset in offsets], list(sizes)


def address(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


#: madvise(2) advice: fill the page tables of a range for writing (Linux 5.14+; older kernels refuse it).
MADV_POPULATE_WRITE = 23


def populate(address: int, length: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_POPULATE_WRITE)


def mapped_spans(fd: int) -> list[tuple[int, int, int]]:
    """Where this process maps the memfd ``fd`` (Mooncake mapped it when mounting): (start, end, offset)."""
    inode = os.fstat(fd).st_ino
    spans = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[4] == str(inode) and "memfd:" in line:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            spans.append((start, end, int(fields[2], 16)))
    return spans
