"""Whom a runner trusts: before it maps or talks to anything under an instance's names, the object must
belong to a trusted user and must not be writable by others.

Trusted: the runner's own user, root, the service user (the owner of ``/run/kvcached``, which only root
can make: systemd makes it for the unit's ``User=``, ``RuntimeDirectory=kvcached``), and the user named by
``KVCACHED_DAEMON_USER`` (a name or a uid: a daemon's user the runner reaches through ``--group`` without
the unit). The same holds for the CLI (``status``, ``list``, ``stop``, ``doctor``). An impostor that created
the control block, a semaphore, an arena or a socket under the instance's names before the daemon started
is refused with ``NotTrusted`` naming the object, its owner and mode, before a byte is mapped or sent.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcached.protocol.errors import InvalidSpec, NotTrusted

ENV = "KVCACHED_DAEMON_USER"
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of the Unix socket ``sock``, as the kernel
    recorded them when the connection was made (``SO_PEERCRED``)."""
    pid, uid, gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    return pid, uid, gid


#: ``systemd/kvcached@.service``'s run directory (``RuntimeDirectory=``), owned by its ``User=``: the service user.
SERVICE_RUN_DIR = Path("/run/kvcached")


def service_uid(path: Path = SERVICE_RUN_DIR) -> int | None:
    """The owner of ``path`` when only root can have given it to them: a directory, not a link, writable by
    nobody but its owner, in a directory of root's that nobody else may write (``/run``); else None."""
    try:
        parent, st = os.lstat(path.parent), os.lstat(path)
    except OSError:
        return None
    if parent.st_uid != 0 or parent.st_mode & 0o022 or not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o022:
        return None
    return st.st_uid


def trusted_uids() -> frozenset[int]:
    """The uids whose objects a runner uses."""
    uids = {os.geteuid(), 0}
    if (service := service_uid()) is not None:
        uids.add(service)
    if named := os.environ.get(ENV, "").strip():
        try:
            uids.add(int(named) if named.isdigit() else pwd.getpwnam(named).pw_uid)
        except KeyError:
            raise InvalidSpec(ENV.lower(), f"{ENV}={named}: no such user on this host") from None
    return frozenset(uids)


def check_owner(what: str, st: os.stat_result, *, owner: int | None = None) -> None:
    """Raise ``NotTrusted`` unless ``st`` (of the object ``what``) belongs to a trusted user (or to exactly
    ``owner`` when given: the daemon's uid, once its control block was trusted) and, unless it is a socket
    (whose write permission only lets one connect), is not writable by others."""
    allowed = {owner} if owner is not None else trusted_uids()
    if st.st_uid not in allowed:
        who = f"uid {owner}" if owner is not None else f"uids {', '.join(map(str, sorted(allowed)))}"
        raise NotTrusted(
            f"{what} belongs to uid {st.st_uid}{_name(pwd.getpwuid, st.st_uid, 'pw_name')}, not to the daemon's "
            f"user ({who}): refusing to use it. An impostor may have made it; remove it, or set {ENV} to the "
            "daemon's user."
        )
    if st.st_mode & stat.S_IWOTH and not stat.S_ISSOCK(st.st_mode):
        raise NotTrusted(
            f"{what} is writable by anyone (mode {stat.S_IMODE(st.st_mode):o}): refusing to use it; kvcached makes "
            "its objects 0600 or 0660"
        )


def admitted(path: object) -> str:
    """Whom the daemon admits to ``path`` (one of its /dev/shm objects or sockets), as its owner and mode
    say, and who this process is: the end of an ``AccessDenied`` message."""
    try:
        st = os.stat(str(path))
    except OSError:
        return "the daemon admits its own user and its --group"
    if st.st_mode & 0o060:
        group = f"the members of its --group, gid {st.st_gid}{_name(grp.getgrgid, st.st_gid, 'gr_name')}"
    else:
        group = "no group (it was started without --group)"
    groups = ", ".join(map(str, sorted({os.getegid(), *os.getgroups()})))
    return (
        f"the daemon admits its own user, uid {st.st_uid}{_name(pwd.getpwuid, st.st_uid, 'pw_name')}, and {group}; "
        f"this process runs as uid {os.geteuid()} in groups {groups}"
    )


def user_name(uid: int) -> str | None:
    """The login name of ``uid``, or None where it has none on this host."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def _name(lookup: Callable[[int], Any], number: int, field: str) -> str:
    """`` (name)`` of a uid or gid, or "" where it has none on this host."""
    try:
        return f" ({getattr(lookup(number), field)})"
    except KeyError:
        return ""
