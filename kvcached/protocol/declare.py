"""The engine declares the geometry: the client side, and the rule that says whether two specs agree.

A daemon started with ``--geometry engine`` knows its ranks, memory and store but not the cache's
geometry (FastDeploy fixes its block count only after profiling). It publishes a control block whose
header spec names the store backend only (``Header.awaits_geometry``) and listens on
``<run_dir>/<instance>.declare.sock`` until the engine's first runner or cache-transfer drop-in declares
the spec; then it allocates exactly that and publishes it in the next control block. One exchange per
connection, JSON lines both ways, and one of three answers::

    -> {"spec": {...CacheSpec fields...}}
    <- {"accepted": true}                                      the daemon allocates this spec
    <- {"accepted": false, "field": F, "daemon": D, "declared": V, "message": M}      refused, by name
    <- {"accepted": false, "busy": true, "message": M}         too many declarations at once: ask again

Busy is never a refusal: ``declare`` returns False for it, as for a daemon no longer listening, and the waiter
asks again on its next look (``runner_client.wait``), within its own deadline.

A declaration that arrives once the spec is published is judged against the header: equal (every field of
``CacheSpec.DECLARED_FIELDS``, ``CacheSpec.first_difference``) adopts; different is refused by name. The
daemon's own store backend always wins over the declared one (the caller checks that separately).
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from kvcached.protocol.errors import AccessDenied, CacheLayoutMismatch, InvalidSpec
from kvcached.protocol.spec import CacheSpec
from kvcached.protocol.trust import admitted, peer_credentials

#: Bytes of one message, at most (a spec is a few hundred).
MAX_MESSAGE = 16384


def declare_socket_path(run_dir: str | Path, instance: str) -> Path:
    """Where a daemon waiting for the engine's geometry listens."""
    return Path(run_dir) / f"{instance}.declare.sock"


def declare(run_dir: str, instance: str, rank: int, spec: CacheSpec, *, owner_uid: int, timeout: float = 5.0) -> bool:
    """Declare ``spec`` (for rank ``rank``) to the daemon of ``instance`` waiting in ``run_dir``. True:
    accepted; False: ask again (the daemon is busy, or not listening any more: it may have taken another
    declaration; look at its next block).
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
            raise AccessDenied(f"{path}: permission denied: {admitted(path)}") from None
        peer_uid = peer_credentials(sock)[1]
        if peer_uid != owner_uid:
            raise InvalidSpec("declare", f"{path} is served by uid {peer_uid}, not the daemon's uid {owner_uid}")
        sock.sendall(json.dumps({"spec": spec.to_dict()}).encode() + b"\n")
        reply = read_message(sock, timeout)
    except (TimeoutError, ConnectionResetError, BrokenPipeError):
        return False
    finally:
        sock.close()
    if reply is None or reply.get("busy") is True:
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
    """The JSON object of ``data``'s first line, or None when it is not one (not JSON, not an object,
    nested deeper than the parser goes)."""
    try:
        message = json.loads(data.split(b"\n", 1)[0])
    except (ValueError, RecursionError):
        return None
    return message if isinstance(message, dict) else None


def parse_declaration(data: bytes) -> CacheSpec:
    """The spec a declaring connection sent in ``data`` (everything it sent, its first line the message).
    Raises ``InvalidSpec`` naming the field and what is allowed: ``spec`` for a message that is too long,
    not JSON, nested too deep, or whose ``spec`` is not an object; a spec field otherwise."""
    line = data.split(b"\n", 1)[0]
    if len(line) > MAX_MESSAGE:
        raise InvalidSpec("spec", f"a declaration is one line of at most {MAX_MESSAGE} bytes; got more")
    form = 'one line of JSON, {"spec": {...CacheSpec fields...}}'
    try:
        message = json.loads(line)
    except RecursionError:
        raise InvalidSpec("spec", f"nested too deep; a declaration is {form}") from None
    except ValueError as exc:
        raise InvalidSpec("spec", f"not JSON ({exc}); a declaration is {form}") from None
    if not isinstance(message, dict):
        raise InvalidSpec("spec", f"a declaration is {form}; got a JSON {type(message).__name__}")
    spec = message.get("spec")
    if not isinstance(spec, dict):
        raise InvalidSpec("spec", f"must be a JSON object of CacheSpec fields; got {type(spec).__name__}")
    try:
        return CacheSpec.from_dict(spec)
    except TypeError as exc:  # a field of the wrong type the spec's own checks did not name
        raise InvalidSpec("spec", str(exc)) from None
