"""Waiting marks: how many runners wait for each rank, counted without writing anything shared.

While a runner waits for rank k it holds an open-file-description read lock (``F_OFD_SETLK``) on byte k
of the instance's control block; the kernel drops it when the runner stops waiting or dies, and
``count_waiters`` counts them from /proc/locks.
"""

from __future__ import annotations

import fcntl
import os
import struct
from pathlib import Path

from kvcached.protocol.names import control_name, open_plain, shm_path

#: ``struct flock`` on 64-bit Linux: type, whence, (pad), start, len, pid, (pad).
_FLOCK = struct.Struct("hh4xqqi4x")


def mark_waiting(instance: str, rank: int) -> int | None:
    """Take a read lock on byte ``rank`` of the control block, held by the returned descriptor until it is
    closed (or the process dies); None if that is not possible (no block, no permission, no OFD locks)."""
    try:
        fd = open_plain(shm_path(control_name(instance)))
    except OSError:
        return None
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, rank, 1, 0))
    except (OSError, AttributeError):
        os.close(fd)
        return None
    return fd


def count_waiters(instance: str, num_ranks: int, locks: str | None = None) -> list[int]:
    """How many processes hold a waiting mark on each rank of ``instance``'s current control block, read
    from /proc/locks (or ``locks``, its text)."""
    counts = [0] * num_ranks
    try:
        st = os.stat(shm_path(control_name(instance)))
        text = locks if locks is not None else Path("/proc/locks").read_text()
    except OSError:
        return counts
    target = (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino)
    for line in text.splitlines():
        fields = line.split()
        # "1: OFDLCK ADVISORY READ -1 00:1a:1234 3 3"; blocked requests have "->" before the type
        if len(fields) != 8 or fields[1] != "OFDLCK" or fields[3] != "READ":
            continue
        try:
            major, minor, inode = fields[5].split(":")
            where = (int(major, 16), int(minor, 16), int(inode))
            start = int(fields[6])
        except ValueError:
            continue
        if where == target and 0 <= start < num_ranks:
            counts[start] += 1
    return counts
