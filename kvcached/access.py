"""Who may use an instance: the daemon's own user always; the members of one configured group too.

Without ``--group`` every object the daemon creates (shared memory, semaphores) is mode 0600 and only the daemon's user
may use the instance. With ``--group G`` (e.g. ``kvcached`` under systemd) those objects carry group G, each with the
least a runner of another user in G needs to attach: the device arenas (its KV cache, which it writes) and the
semaphores (``sem_open`` needs both) 0660; the control block and the instance lock 0640 (runners read them: a member can
neither forge a record nor block a start); CPU pools and key directories 0600 (only the daemon's workers map them). Task
sockets are mode 0660 either way (group G, or the daemon's group); the file mode is the first gate, and each connection
is then checked by the kernel's peer credentials (``SO_PEERCRED`` / ``SO_PEERGROUPS``): a peer that is neither the
daemon's user nor in G is refused and logged before any byte of a task is read. Root gets no exemption: it may open the
socket file, so it must pass the same check.
"""

from __future__ import annotations

import dataclasses
import grp
import os
import pwd
import socket
import struct
from pathlib import Path

from kvcached.protocol.proc import status_values
from kvcached.protocol.trust import peer_credentials

#: Linux's SO_PEERGROUPS (not exported by Python's socket module).
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
#: Python's getsockopt() takes at most 1024 bytes: 256 groups; a peer in more is read from /proc.
_GROUPS_BUFFER = 1024
SOCKET_MODE = 0o660
#: Objects only the daemon's own processes map (CPU pools, key directories), whatever the group.
PRIVATE_MODE = 0o600


def resolve_group(value: str | int) -> int:
    """The gid of a group name or number; ``KeyError`` with the reason if there is no such group."""
    text = str(value).strip()
    try:
        return grp.getgrgid(int(text)).gr_gid if text.isdigit() else grp.getgrnam(text).gr_gid
    except KeyError:
        raise KeyError(f"no group {text!r} on this host (see /etc/group)") from None


def resolve_user(value: str | int) -> int:
    """The uid of a user name or number; ``KeyError`` with the reason if there is no such user."""
    text = str(value).strip()
    if text.isdigit():
        return int(text)
    try:
        return pwd.getpwnam(text).pw_uid
    except KeyError:
        raise KeyError(f"no user {text!r} on this host (see /etc/passwd)") from None


@dataclasses.dataclass(frozen=True, slots=True)
class Peer:
    """A connected client as the kernel saw it at connect()."""

    pid: int
    uid: int
    gids: frozenset[int]


def peer_of(sock: socket.socket) -> Peer:
    """The peer credentials of a connected Unix socket: pid, uid, primary and supplementary gids."""
    pid, uid, gid = peer_credentials(sock)
    gids = {gid}
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _GROUPS_BUFFER)
        gids.update(struct.unpack(f"{len(raw) // 4}I", raw))
    except OSError:  # more groups than the buffer holds, or a kernel before 4.13
        gids.update(int(gid) for gid in status_values(pid, "Groups"))
    return Peer(pid, uid, frozenset(gids))


@dataclasses.dataclass(frozen=True, slots=True)
class Access:
    """The policy of one instance. ``gid`` None: the daemon's user only."""

    uid: int
    gid: int | None = None

    @classmethod
    def for_daemon(cls, gid: int | None) -> Access:
        return cls(os.geteuid(), gid)

    @property
    def mode(self) -> int:
        """Mode of the shared-memory objects and semaphores the daemon creates."""
        return 0o600 if self.gid is None else 0o660

    @property
    def read_mode(self) -> int:
        """Mode of what the group's runners only read (the control block, the instance lock)."""
        return 0o600 if self.gid is None else 0o640

    @property
    def group(self) -> int:
        """The group the instance's objects carry: ``gid``, or without one the daemon's own group."""
        return os.getegid() if self.gid is None else self.gid

    def allows(self, peer: Peer) -> bool:
        return peer.uid == self.uid or (self.gid is not None and self.gid in peer.gids)

    def apply(self, target: int | Path, mode: int | None = None) -> None:
        """Give a file descriptor or path our group and ``mode`` (the shared ``mode`` by default), whatever an earlier
        start gave it: an object adopted across a change of ``--group`` follows the change."""
        mode = self.mode if mode is None else mode
        if isinstance(target, int):
            os.fchown(target, -1, self.group)
            os.fchmod(target, mode)
        else:  # owner only while the group changes: neither group has more than it is given
            os.chmod(target, 0o600)
            os.chown(target, -1, self.group)
            os.chmod(target, mode)

    def apply_socket(self, path: Path) -> None:
        """Task sockets: 0660, group ``gid`` (or the daemon's own group)."""
        os.chown(path, -1, self.group)
        os.chmod(path, SOCKET_MODE)
