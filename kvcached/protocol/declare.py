"""The engine declares the geometry: the client side, and the rule that says whether two specs agree.

A daemon started with ``--geometry engine`` knows its ranks, memory and store but not the cache's
geometry (FastDeploy fixes its block count only after profiling). It publishes a control block whose
header spec names the store backend only (``Header.awaits_geometry``) and listens on
``<run_dir>/<instance>.declare.sock`` until the engine's first runner or cache-transfer drop-in declares
the spec; then it allocates exactly that and publishes it in the next control block. One exchange per
connection, JSON lines both ways::

    -> {"spec": {...CacheSpec fields...}}
    <- {"accepted": true}                                      the daemon allocates this spec
    <- {"accepted": false, "field": F, "daemon": D, "declared": V, "message": M}

A declaration that arrives once the spec is published is judged here, against the header: equal (every
field of ``MATCHED_FIELDS`` and the role) adopts; different is refused by name. The daemon's own store
backend always wins over the declared one (the caller checks that separately).
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvcached.protocol.errors import AccessDenied, CacheLayoutMismatch, InvalidSpec
from kvcached.protocol.spec import CacheSpec

#: Spec fields a runner and its daemon must agree on, in the order they are compared.
MATCHED_FIELDS = (
    "num_layers",
    "kv_heads",
    "head_dim",
    "block_size",
    "dtype",
    "num_blocks",
    "block_wise_fp8",
    "mla",
    "scale_dtype",
    "mtp_layers",
    "mtp_num_blocks",
    "num_cpu_blocks",
)
#: A declaration also fixes the role (it decides the owner with the store).
DECLARED_FIELDS = (*MATCHED_FIELDS, "splitwise_role")
#: Bytes of one message, at most (a spec is a few hundred).
MAX_MESSAGE = 16384
_ADDED_LATER = {"mtp_layers": 0, "mtp_num_blocks": 0}


def declare_socket_path(run_dir: str | Path, instance: str) -> Path:
    """Where a daemon waiting for the engine's geometry listens."""
    return Path(run_dir) / f"{instance}.declare.sock"


def first_difference(
    published: Mapping[str, Any], spec: CacheSpec, fields: tuple[str, ...] = MATCHED_FIELDS
) -> tuple[str, Any, Any] | None:
    """``(field, published value, spec's value)`` of the first of ``fields`` that differs, else None. The
    scale dtype counts only with scale tensors; fields added after the first release read 0 when absent."""
    for field in fields:
        if field == "scale_dtype" and not spec.block_wise_fp8:
            continue  # no scale tensors: their dtype shapes nothing
        ours = getattr(spec, field)
        theirs = published.get(field, _ADDED_LATER.get(field))
        if theirs != ours:
            return field, theirs, ours
    return None


def declare(run_dir: str, instance: str, rank: int, spec: CacheSpec, *, owner_uid: int, timeout: float = 5.0) -> bool:
    """Declare ``spec`` (for rank ``rank``) to the daemon of ``instance`` waiting in ``run_dir``. True:
    accepted; False: the daemon is not listening (any more: it may have taken another declaration; look at
    its next block).
    Raises ``CacheLayoutMismatch`` when it refuses, naming the field, ``AccessDenied`` when this user may not
    connect, and ``InvalidSpec`` when the listener is not the daemon's user (``owner_uid``)."""
    path = declare_socket_path(run_dir, instance)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except PermissionError:
            raise AccessDenied(f"{path}: permission denied: the daemon admits its own user and its --group") from None
        peer_uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if peer_uid != owner_uid:
            raise InvalidSpec("declare", f"{path} is served by uid {peer_uid}, not the daemon's uid {owner_uid}")
        sock.sendall(json.dumps({"spec": spec.to_dict()}).encode() + b"\n")
        reply = read_message(sock, timeout)
    except (TimeoutError, ConnectionResetError, BrokenPipeError):
        return False
    finally:
        sock.close()
    if reply is None:
        return False
    if reply.get("accepted") is True:
        return True
    raise CacheLayoutMismatch(
        str(reply.get("field")),
        reply.get("daemon"),
        reply.get("declared"),
        instance=instance,
        rank=rank,
        why=f"the daemon refused the declared geometry: {reply.get('message')}",
    )


def read_message(sock: socket.socket, seconds: float) -> dict[str, Any] | None:
    """One JSON object ending in a newline (at most ``MAX_MESSAGE`` bytes), whole within ``seconds`` (else
    ``TimeoutError``, however the bytes trickle in), or None for anything else."""
    deadline = time.monotonic() + seconds
    data = b""
    while b"\n" not in data and len(data) <= MAX_MESSAGE:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return parse_message(data)


def parse_message(data: bytes) -> dict[str, Any] | None:
    """The JSON object of ``data``'s first line, or None when it is not one."""
    try:
        message = json.loads(data.split(b"\n", 1)[0])
    except ValueError:
        return None
    return message if isinstance(message, dict) else None
