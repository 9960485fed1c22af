"""The file store's directories: where they are by default, whose they may be (every load serves what they hold), and
whose files fill their disk when it is full."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import stat
from pathlib import Path

from kvcached.checks import size_text


def default_storage_path(instance: str) -> Path:
    """``$CACHE_DIRECTORY/<instance>/store`` under systemd (CacheDirectory=), else the user's cache directory."""
    base = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    if not base:
        base = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvcached")
    return Path(base) / instance / "store"


def unsafe_directory(path: Path) -> str | None:
    """Why ``path`` (a store or rank directory) may not hold this daemon's objects, or None. Loads serve what it holds,
    so only the daemon's user may write it: it must be that user's and closed to group and others (the store never
    shares it: runners read blocks from the cache, not the store), and each directory above it root's or that user's,
    writable by others only with the sticky bit (else another user could move it away and put theirs in its place)."""
    uid = os.geteuid()
    if (why := _unsafe_link(path, uid)) is not None:
        return why
    resolved = path.resolve()
    st = os.stat(resolved)
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if st.st_uid != uid or st.st_mode & 0o022:
        return (
            f"{path} is owned by {_user(st.st_uid)} with mode {stat.S_IMODE(st.st_mode):04o}; a store directory "
            f"must be owned by the daemon's user, {_user(uid)}, and writable by nobody else (whoever can write it "
            f"can plant objects that loads serve): `chown {uid} {path} && chmod go-w {path}`, or give another "
            "--storage-path"
        )
    for above in resolved.parents:
        st = os.stat(above)
        if st.st_uid not in (0, uid) or _open_to_others(st):
            return (
                f"{above}, above the store directory {path}, is owned by {_user(st.st_uid)} with mode "
                f"{stat.S_IMODE(st.st_mode):04o}: another user could put a directory of their own in the store's "
                f"place; make it root's or {_user(uid)}'s and closed to others (or sticky, as /tmp is), or give "
                "another --storage-path"
            )
    return None


def _unsafe_link(path: Path, uid: int) -> str | None:
    """Why another user could repoint a symbolic link on the way to ``path`` (followed as the kernel does), or None:
    each link and its directory must be root's or this user's, the directory writable by others only if sticky."""
    parts, here, hops = list(Path(os.path.abspath(path)).parts), Path("/"), 0
    while parts:
        name = parts.pop(0)
        step = Path(name) if name == "/" else here.parent if name == ".." else here / name
        if not step.is_symlink():
            here = step
            continue
        hops += 1
        link, holder = os.lstat(step), os.stat(here)
        if hops > 40:
            return f"{path}: too many symbolic links on the way"
        if link.st_uid not in (0, uid) or holder.st_uid not in (0, uid) or _open_to_others(holder):
            return (
                f"{step}, a symbolic link on the way to the store directory {path}, is owned by "
                f"{_user(link.st_uid)} in {here}, owned by {_user(holder.st_uid)} with mode "
                f"{stat.S_IMODE(holder.st_mode):04o}: another user could point it elsewhere; give the resolved "
                "--storage-path, or make the link and its directory root's or the daemon's user's"
            )
        parts = [*Path(os.readlink(step)).parts, *parts]  # a relative target goes on from ``here``
    return None


def _open_to_others(st: os.stat_result) -> bool:
    return bool(st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX)


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def nearest_existing(path: Path) -> Path:
    """``path``, or the nearest directory above it that exists."""
    while not path.exists():
        path = path.parent
    return path


def full_disk(root: Path) -> str:
    """Why a full disk left a rank of the store at ``root`` nothing to evict, and what to do: whose files fill it, the
    store's own (every rank's) or others'."""
    ours = 0
    for directory, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):  # another rank may evict it meanwhile
                ours += os.lstat(os.path.join(directory, name)).st_blocks * 512
    disk = shutil.disk_usage(root)
    held = f"{size_text(ours)} of the {size_text(disk.used)} used on the disk of {root} are this store's"
    if ours * 2 >= disk.used:
        return (
            f"this store's own objects fill the disk ({held}: the other ranks' share and this task's own "
            f"blocks, which this rank does not evict): lower --storage-capacity below what the disk holds "
            f"({size_text(disk.total)}), or give the store a larger disk"
        )
    return f"the store has nothing left to evict: other files fill the disk ({held})"
