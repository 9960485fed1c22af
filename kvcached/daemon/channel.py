"""The supervisor <-> rank worker channel: a SOCK_SEQPACKET socket pair, one typed message per packet.

::

    worker -> supervisor   Allocating(total)               before reserving
                           Progress(done)                  while reserving (at most every 100 ms)
                           Prepared()                      memory reopened; waits for Serve (a restart: the last
                                                           image's worker still serves the rank)
                           Ready(backend, descriptor, ...) the rank's tiers exist and the task socket listens
                           Failed(error, exit_status)      the worker cannot go on; it exits next
    supervisor -> worker   Stop(drain)                     (EOF means the same); with drain, the worker first answers
                                                           what clients send NOT_RUN, for at most ``DRAIN_S``
                           Serve()                         after Prepared: the rank is yours, serve it

On the wire a message is a packet holding a JSON object (``kvcached.protocol.framing``) whose ``"t"`` names
its type; ``send`` and ``recv`` are the only functions that see that encoding.
"""

from __future__ import annotations

import dataclasses
import socket
from typing import Any, get_args

from kvcached.protocol import framing
from kvcached.protocol.errors import ProtocolError

#: The longest a worker told ``Stop(drain=True)`` goes on answering its clients before it exits.
DRAIN_S = 1.0


@dataclasses.dataclass(frozen=True, slots=True)
class Allocating:
    total: int


@dataclasses.dataclass(frozen=True, slots=True)
class Progress:
    done: int


@dataclasses.dataclass(frozen=True, slots=True)
class Ready:
    backend: str
    descriptor: dict[str, Any]
    dev_bytes: int
    cpu_name: str
    cpu_bytes: int
    layout_version: int


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    error: str
    exit_status: int


@dataclasses.dataclass(frozen=True, slots=True)
class Prepared:
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Serve:
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Stop:
    #: Run the requests clients already sent, and send their replies, before exiting (a handover).
    drain: bool = False


Message = Allocating | Progress | Ready | Failed | Stop | Prepared | Serve
_TYPES: dict[str, type[Any]] = {cls.__name__.lower(): cls for cls in get_args(Message)}


def send(sock: socket.socket, message: Message) -> None:
    """Send one message as one packet (raises ``OSError`` when the peer is gone)."""
    body = {"t": type(message).__name__.lower(), **dataclasses.asdict(message)}
    sock.send(framing.encode(body))


def recv(sock: socket.socket) -> Message | None:
    """Receive one message; None on EOF (the peer is gone); a packet not one of ours raises ``ProtocolError``."""
    try:
        data = sock.recv(framing.CHANNEL)
    except ConnectionResetError:
        return None
    if not data:
        return None
    body = framing.decode(data, "worker channel")
    try:
        cls = _TYPES[body.pop("t")]
        message: Message = cls(**body)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProtocolError(f"worker channel: not a message ({exc!r}): {data[:80]!r}") from None
    return message
