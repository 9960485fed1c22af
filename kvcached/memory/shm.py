"""Named POSIX shared-memory arenas, reserved up front: the host backend's device tier and every CPU pool.

Every arena is created exclusively (O_EXCL), its mode and group set before a byte is reserved, and is reserved before it
is used, so a /dev/shm too small is an error here, at start-up, never a SIGBUS at a page's first touch later: with
``posix_fallocate``, or, where huge pages are asked for and /dev/shm gives them only on request (mounted
``huge=advise``), by ``MADV_HUGEPAGE`` then ``MADV_POPULATE_WRITE`` (which fails with an error, not a SIGBUS).

Page tables are not filled here: a rank is READY as soon as its memory is reserved, and ``prefault`` maps every page on
a background thread right after (a fresh shm mapping otherwise takes one page fault per page on first touch, which makes
a first swap several times slower: ``scripts/bench_copy_choices.py``, docs/benchmarks.md). The file descriptor is closed
as soon as the mapping exists.

Huge pages (``huge_pages``): /dev/shm is a tmpfs whose ``huge=`` mount option decides whether its pages are 2 MiB
(``always``, ``within_size``), 2 MiB when a mapping asks (``advise``: the arenas ask) or 4 KiB (``never``, the default);
``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` can force or deny it host-wide. Fewer, larger pages make the cold
start and random-order swaps faster (fewer page faults and TLB misses). ``kvcached doctor`` says what the host gives."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import posix_ipc

from kvcached.protocol.errors import ProtocolError, ShmFull
from kvcached.protocol.trust import check_owner

MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)  # Linux; named in the mmap module from Python 3.10

#: Reserve in chunks of this size so progress can be reported while a large arena is reserved.
CHUNK = 256 << 20


def create_arena(
    name: str,
    size: int,
    progress: Callable[[int], None] | None = None,
    *,
    mode: int = 0o600,
    gid: int | None = None,
    huge: bool = False,
) -> mmap.mmap:
    """Create, reserve (``progress(done)`` after each chunk) and map shm object ``name`` of ``size`` bytes, with
    ``mode`` and group ``gid`` if given (see the module); with ``huge``, ask for huge pages. On any error nothing is
    left: raises ``posix_ipc.ExistentialError`` if the name exists, ``ShmFull`` if /dev/shm is too small."""
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
    try:
        os.fchmod(shm.fd, mode)
        if gid is not None:
            os.fchown(shm.fd, -1, gid)
        if huge and huge_pages() == "advise":
            mapping = _populated(shm.fd, size, progress)
            if mapping is not None:
                return mapping
        for done in range(0, size, CHUNK):
            os.posix_fallocate(shm.fd, done, min(CHUNK, size - done))
            if progress is not None:
                progress(min(done + CHUNK, size))
        mapping = mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED)
        if huge:
            _advise(mapping, 0, size, MADV_HUGEPAGE)
        return mapping
    except BaseException as exc:
        shm.unlink()
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFAULT):
            raise ShmFull(f"/dev/shm is full: cannot reserve {size} bytes for {name}") from None
        raise
    finally:
        shm.close_fd()


def _populated(fd: int, size: int, progress: Callable[[int], None] | None) -> mmap.mmap | None:
    """Reserve by mapping huge pages (``MADV_HUGEPAGE``, then ``MADV_POPULATE_WRITE`` chunk by chunk); None where the
    kernel lacks ``MADV_POPULATE_WRITE`` (Linux < 5.14: then ``posix_fallocate`` reserves)."""
    os.ftruncate(fd, size)
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    try:
        _advise(mapping, 0, size, MADV_HUGEPAGE)
        for done in range(0, size, CHUNK):
            code = _advise(mapping, done, min(CHUNK, size - done), MADV_POPULATE_WRITE)
            if code == errno.EINVAL and done == 0:
                mapping.close()
                return None
            if code:
                raise OSError(code, os.strerror(code))
            if progress is not None:
                progress(min(done + CHUNK, size))
    except BaseException:
        mapping.close()
        raise
    return mapping


def open_arena(name: str, size: int, *, populate: bool = True, owner: int | None = None) -> mmap.mmap:
    """Map the existing shm object ``name`` (read-write), bytes untouched, checking it holds at least ``size`` bytes
    (and, with ``owner``, is that uid's and not writable by others). Raises ``posix_ipc.ExistentialError`` (absent),
    ``posix_ipc.PermissionsError``, ``ProtocolError`` (too small), ``NotTrusted``."""
    shm = posix_ipc.SharedMemory(name)
    try:
        st = os.fstat(shm.fd)
        if owner is not None:
            check_owner(f"arena /dev/shm{name}", st, owner=owner)
        if st.st_size < size:
            raise ProtocolError(f"{name} has {st.st_size} bytes, the layout needs {size}")
        return mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED | (MAP_POPULATE if populate else 0))
    finally:
        shm.close_fd()


#: Modes kvcached gives its objects (0600 alone; with --group 0660, 0640 what runners only read).
OUR_MODES = (0o600, 0o640, 0o660)


def why_not_ours(name: str, size: int) -> str | None:
    """Why shm object ``name`` cannot be taken over as ours with at least ``size`` bytes, or None; opens nothing."""
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
        return f"{path} has mode {stat.S_IMODE(st.st_mode):o}; kvcached makes 600, 640 or 660"
    if st.st_size < size:
        return f"{path} has {st.st_size} bytes, the layout needs {size}"
    return None


#: madvise advice that maps every page of a range writable without changing a byte (Linux 5.14).
MADV_POPULATE_WRITE = 23
MADV_HUGEPAGE = 14

_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_LIBC.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def _address(mapping: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))  # dropped at once: a live export keeps it from closing


def _advise(mapping: mmap.mmap, start: int, length: int, advice: int) -> int:
    """madvise on part of ``mapping`` with the GIL released; 0, or the errno."""
    return 0 if _LIBC.madvise(_address(mapping) + start, length, advice) == 0 else ctypes.get_errno()


def huge_pages(
    mounts: str = "/proc/self/mounts", policy: str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
) -> str:
    """What /dev/shm gives (see the module): its ``huge=`` option, or ``force``/``deny`` from the host-wide policy."""
    try:
        chosen = Path(policy).read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        chosen = ""
    if chosen in ("force", "deny"):
        return chosen
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return "never"
    found = "never"
    for line in lines:
        fields = line.split()
        if len(fields) > 3 and fields[1] == "/dev/shm":
            options = [option.partition("=") for option in fields[3].split(",")]
            found = next((value for key, _, value in options if key == "huge"), "never")  # the last mount wins
    return found


def gives_huge_pages(mode: str) -> bool:
    """Whether arenas that ask for huge pages get them on /dev/shm in ``mode`` (``huge_pages()``)."""
    return mode in ("always", "within_size", "advise", "force")


def prefault(mapping: mmap.mmap) -> threading.Thread:
    """Map every page of ``mapping`` on a background thread (``MADV_POPULATE_WRITE``, GIL released), so a reopened arena
    serves at once and its first copies take no page faults (a kernel without the advice maps them at first touch)."""
    return prefault_ranges([(_address(mapping), len(mapping))])


def prefault_ranges(ranges: list[tuple[int, int]]) -> threading.Thread:
    """``prefault`` for address ranges of mappings this process holds (another process's view of an arena:
    a fork does not copy the page tables of shared mappings)."""
    pages = [(address - address % mmap.PAGESIZE, size + address % mmap.PAGESIZE) for address, size in ranges]

    def run() -> None:
        for address, size in pages:
            for start in range(0, size, CHUNK):  # in steps: a mapping closed meanwhile ends it early (ENOMEM)
                if _LIBC.madvise(address + start, min(CHUNK, size - start), MADV_POPULATE_WRITE) != 0:
                    return

    thread = threading.Thread(target=run, name="prefault", daemon=True)
    thread.start()
    return thread


def shm_free_bytes() -> int:
    """Bytes an unprivileged process may still allocate in /dev/shm."""
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def pin(mapping: mmap.mmap) -> None:
    """Lock ``mapping`` in RAM (``mlock``), as device DMA from host memory needs. Raises ``OSError`` (e.g. EAGAIN/ENOMEM
    when RLIMIT_MEMLOCK is lower than the mapping) with nothing locked."""
    if _LIBC.mlock(_address(mapping), len(mapping)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mlock of {len(mapping)} bytes failed: {os.strerror(code)}; raise the memlock limit")
