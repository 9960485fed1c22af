"""The engine declares the geometry: the client side, and the rule that says whether two specs agree.

A daemon started with ``--geometry engine`` knows its ranks, memory and store but not the cache's geometry (FastDeploy
fixes its block count only after profiling). It publishes a control block whose header spec names the store backend only
(``Header.awaits_geometry``) and listens on ``<run_dir>/<instance>.declare.sock`` until the engine's first runner or
cache-transfer drop-in declares the spec; then it allocates exactly that and publishes it in the next control block. One
exchange per connection, a frame of JSON each way (``kvcached.protocol.framing``), and one of three answers::

    -> {"spec": {...CacheSpec fields...}}
    <- {"accepted": true}                                      the daemon allocates this spec
    <- {"accepted": false, "field": F, "daemon": D, "declared": V, "message": M}      refused, by name
    <- {"accepted": false, "busy": true, "message": M}         too many declarations at once: ask again

Busy is never a refusal: ``declare`` answers ``BUSY`` for it (and for a listening queue that is full), and the
waiter asks again on its next look (``runner_client.wait``), within its own deadline, saying so while it waits.

A declaration that arrives once the spec is published is judged against the header: equal (every field of
``CacheSpec.DECLARED_FIELDS``, ``CacheSpec.first_difference``) adopts; different is refused by name. The
daemon's own store backend always wins over the declared one (the caller checks that separately).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from kvcached.protocol import framing
from kvcached.protocol.errors import AccessDenied, CacheLayoutMismatch, InvalidSpec, ProtocolError
from kvcached.protocol.spec import CacheSpec
from kvcached.protocol.trust import admitted, peer_credentials

WHAT = "declaration"


def declare_socket_path(run_dir: str | Path, instance: str) -> Path:
    """Where a daemon waiting for the engine's geometry listens."""
    return Path(run_dir) / f"{instance}.declare.sock"


#: What ``declare`` answers: the daemon took the spec; it is busy (ask again); it is not listening any more (it
#: may have taken another declaration: look at its next block).
ACCEPTED, BUSY, GONE = "accepted", "busy", "gone"


def declare(run_dir: str, instance: str, rank: int, spec: CacheSpec, *, owner_uid: int, timeout: float = 5.0) -> str:
    """Declare ``spec`` (for rank ``rank``) to the daemon of ``instance`` waiting in ``run_dir``, within ``timeout``
    seconds: ``ACCEPTED``, ``BUSY`` or ``GONE``. Raises ``CacheLayoutMismatch`` when it refuses, naming the field,
    ``AccessDenied`` when this user may not connect, ``InvalidSpec`` when the listener is not ``owner_uid``."""
    path = declare_socket_path(run_dir, instance)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            return GONE
        except BlockingIOError:  # its listening queue is full: as busy as a busy answer
            return BUSY
        except PermissionError:
            raise AccessDenied(f"{path}: permission denied: {admitted(path)}") from None
        peer_uid = peer_credentials(sock)[1]
        if peer_uid != owner_uid:
            raise InvalidSpec("declare", f"{path} is served by uid {peer_uid}, not the daemon's uid {owner_uid}")
        framing.send(sock, framing.encode({"spec": spec.to_dict()}))
        body = framing.Reader(framing.DECLARATION, WHAT).receive(sock, time.monotonic() + timeout)
        reply = framing.decode(body, WHAT)
    except (TimeoutError, ConnectionError, ProtocolError):  # closed, no whole answer in time, or not JSON
        return GONE
    finally:
        sock.close()
    if reply.get("busy") is True:
        return BUSY
    if reply.get("accepted") is True:
        return ACCEPTED
    raise CacheLayoutMismatch(
        str(reply.get("field")),
        reply.get("daemon"),
        reply.get("declared"),
        instance=instance,
        rank=rank,
        why=f"the daemon refused the declared geometry: {reply.get('message')}",
    )


def parse_declaration(reader: framing.Reader) -> CacheSpec | None:
    """The spec of the whole declaration ``reader`` holds, or None while it is not whole. Raises
    ``InvalidSpec`` naming the field and what is allowed: ``spec`` for a frame that is too long, not JSON,
    nested too deep, or whose ``spec`` is not an object; a spec field otherwise."""
    form = 'one frame (a u32 length, then JSON {"spec": {...CacheSpec fields...}})'
    try:
        body = reader.next()
        if body is None:
            return None
        message = framing.decode(body, WHAT)
    except ProtocolError as exc:
        raise InvalidSpec("spec", f"{exc}; a declaration is {form}") from None
    spec = message.get("spec")
    if not isinstance(spec, dict):
        raise InvalidSpec("spec", f"must be a JSON object of CacheSpec fields; got {type(spec).__name__}")
    try:
        return CacheSpec.from_dict(spec)
    except InvalidSpec:
        raise
    except (TypeError, ValueError) as exc:  # a field the spec's own checks did not name
        raise InvalidSpec("spec", str(exc)[:200]) from None
