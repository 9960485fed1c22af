"""Named POSIX shared-memory arenas, reserved up front: the host backend's device tier and every CPU pool.

Every arena is created exclusively (O_EXCL) with mode 0600 and reserved with ``posix_fallocate`` before
it is mapped, so a /dev/shm that is too small is an error here, at start-up, and never a SIGBUS when a
page is first touched later. The mapping is populated (MAP_POPULATE) before the rank is READY: a fresh
shm mapping otherwise takes one page fault per 4 KiB on first touch, which made a first swap of 1 GiB
run at 0.5 GB/s instead of 12. The file descriptor is closed as soon as the mapping exists.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import threading
from collections.abc import Callable

import posix_ipc

from kvcached.protocol.errors import ProtocolError, ShmFull
from kvcached.protocol.trust import check_owner

MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)  # Linux; named in the mmap module from Python 3.10

#: Reserve in chunks of this size so progress can be reported while a large arena is reserved.
CHUNK = 256 << 20


def create_arena(
    name: str, size: int, progress: Callable[[int], None] | None = None, *, mode: int = 0o600, gid: int | None = None
) -> mmap.mmap:
    """Create, reserve and map shm object ``name`` of ``size`` bytes, with ``mode`` (and group ``gid`` if
    given; both set before a byte is reserved). On any error nothing is left.

    Raises ``posix_ipc.ExistentialError`` if the name exists, ``ShmFull`` if /dev/shm is too small.
    ``progress(done)`` is called after each reserved chunk.
    """
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
    try:
        os.fchmod(shm.fd, mode)
        if gid is not None:
            os.fchown(shm.fd, -1, gid)
        done = 0
        while done < size:
            step = min(CHUNK, size - done)
            os.posix_fallocate(shm.fd, done, step)
            done += step
            if progress is not None:
                progress(done)
        return mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED | MAP_POPULATE)
    except BaseException as exc:
        shm.unlink()
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise ShmFull(f"/dev/shm is full: cannot reserve {size} bytes for {name}") from None
        raise
    finally:
        shm.close_fd()


def open_arena(name: str, size: int, *, populate: bool = True, owner: int | None = None) -> mmap.mmap:
    """Map the existing shm object ``name`` (read-write), checking it holds at least ``size`` bytes (and,
    with ``owner``, that it belongs to that uid and is not writable by others); its bytes are untouched.
    Raises ``posix_ipc.ExistentialError`` (absent), ``posix_ipc.PermissionsError``, ``ProtocolError`` (too
    small), ``NotTrusted``."""
    shm = posix_ipc.SharedMemory(name)
    try:
        st = os.fstat(shm.fd)
        if owner is not None:
            check_owner(f"arena /dev/shm{name}", st, owner=owner)
        actual = st.st_size
        if actual < size:
            raise ProtocolError(f"{name} has {actual} bytes, the layout needs {size}")
        return mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED | (MAP_POPULATE if populate else 0))
    finally:
        shm.close_fd()


#: Modes kvcached gives its objects (0600 alone, 0660 with --group).
OUR_MODES = (0o600, 0o660)


def why_not_ours(name: str, size: int) -> str | None:
    """Why shm object ``name`` cannot be taken over as one of ours of at least ``size`` bytes (absent, not a
    plain object, another owner, foreign permissions, too small), or None when it can. Nothing is opened."""
    path = f"/dev/shm{name}"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"{path} is gone"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a shared-memory object"
    if st.st_uid != os.geteuid():
        return f"{path} is owned by uid {st.st_uid}, not by this daemon's uid {os.geteuid()}"
    if stat.S_IMODE(st.st_mode) not in OUR_MODES:
        return f"{path} has mode {stat.S_IMODE(st.st_mode):o}; kvcached makes 600 or 660"
    if st.st_size < size:
        return f"{path} has {st.st_size} bytes, the layout needs {size}"
    return None


#: madvise advice that maps every page of a range writable without changing a byte (Linux 5.14).
MADV_POPULATE_WRITE = 23


def prefault(mapping: mmap.mmap) -> threading.Thread:
    """Map every page of ``mapping`` on a background thread (``MADV_POPULATE_WRITE``; the GIL is released),
    so that a reopened arena serves at once and its first copies take no page faults. Bytes are untouched.
    Where the kernel lacks the advice, pages are mapped as they are first touched instead."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    anchor = ctypes.c_char.from_buffer(mapping)
    address, size = ctypes.addressof(anchor), len(mapping)
    del anchor  # a live export would keep the mapping from being closed

    def run() -> None:
        for start in range(0, size, CHUNK):  # in steps: a mapping closed meanwhile ends it early (ENOMEM)
            if libc.madvise(address + start, min(CHUNK, size - start), MADV_POPULATE_WRITE) != 0:
                return

    thread = threading.Thread(target=run, name="prefault", daemon=True)
    thread.start()
    return thread


def unlink(name: str) -> bool:
    """Remove shm object ``name``; False if it did not exist."""
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        return False
    return True


def shm_free_bytes() -> int:
    """Bytes an unprivileged process may still allocate in /dev/shm."""
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def pin(mapping: mmap.mmap) -> None:
    """Lock ``mapping`` in RAM (``mlock``), as device DMA from host memory needs. Raises ``OSError`` (e.g.
    EAGAIN/ENOMEM when RLIMIT_MEMLOCK is lower than the mapping) with nothing locked."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    anchor = ctypes.c_char.from_buffer(mapping)  # the mapping's first byte, as a ctypes object
    address = ctypes.addressof(anchor)
    del anchor  # a live export would keep the mapping from being closed
    if libc.mlock(address, len(mapping)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mlock of {len(mapping)} bytes failed: {os.strerror(code)}; raise the memlock limit")
