"""Frames of the host-local control protocols, and their limits, in one place.

Every control protocol spoken over a Unix stream socket frames a message the same way: a u32 length
(little-endian), then that many bytes of body. The body is a JSON object (``encode``/``decode``), except on
the store agent's channel, where both ends are the same program and a body is a pickle.

================  ==========================================  ====================  =================
protocol          between                                     body                  a frame at most
================  ==========================================  ====================  =================
declaration       the engine's drop-in or runner, the daemon  JSON                  ``DECLARATION``
keeper link       a store agent, the host's Mooncake keeper   JSON (+ descriptors)  ``KEEPER``
store agent       a rank worker, its store agent              pickle                ``AGENT``
worker channel    the supervisor, a rank worker               JSON (one packet)     ``CHANNEL``
================  ==========================================  ====================  =================

The worker channel is a SOCK_SEQPACKET pair: a packet is a message, so it needs no length; its body is
``encode``'s. The task protocol (``kvcached.protocol.messages``) is the data plane's binary frame, read in
place under an input budget (``kvcached.daemon.frames``): not a control protocol.

A frame longer than its protocol's limit, or a body that is not what the protocol carries (not JSON, not an
object, nested deeper than the parser goes), is a ``ProtocolError``: the peer speaks something else, and the
connection it came on is closed.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

from kvcached.protocol.errors import ProtocolError

HEAD = struct.Struct("<I")
#: A declaration carries one spec (a few hundred bytes).
DECLARATION = 16384
#: A keeper request or reply names objects (a batch of keys, a segment's index).
KEEPER = 64 << 20
#: A store agent's call or reply names keys and counters.
AGENT = 64 << 20
#: A worker channel message: a rank's descriptor at most.
CHANNEL = 1 << 16


def frame(body: bytes) -> bytes:
    """``body`` as one frame."""
    return HEAD.pack(len(body)) + body


def encode(message: dict[str, Any]) -> bytes:
    """A JSON body (compact; values JSON cannot carry are written as their ``str``)."""
    return json.dumps(message, separators=(",", ":"), default=str).encode()


def decode(body: bytes, what: str) -> dict[str, Any]:
    """The JSON object of ``body``; ``ProtocolError`` naming ``what`` (the protocol) for anything else."""
    try:
        message = json.loads(body)
    except RecursionError:
        raise ProtocolError(f"{what}: a message nested too deep") from None
    except ValueError as exc:
        raise ProtocolError(f"{what}: a message that is not JSON ({exc})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"{what}: a message that is a JSON {type(message).__name__}, not an object")
    return message


def send(sock: socket.socket, body: bytes, fds: tuple[int, ...] | list[int] = ()) -> None:
    """Send ``body`` as one frame (and ``fds`` with its first byte), blocking per the socket's timeout."""
    data = frame(body)
    if fds:
        data = data[socket.send_fds(sock, [data], list(fds)) :]
    if data:
        sock.sendall(data)


class Reader:
    """Whole frames of one stream: ``feed`` what was received, take frames with ``next``; or ``receive``
    from a socket, waiting. Descriptors that came with the bytes wait in ``fds`` (``take_fds``)."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit, self.what = limit, what
        self.buffer = bytearray()
        self.fds: list[int] = []

    def feed(self, data: bytes, fds: list[int] | None = None) -> None:
        self.buffer += data
        self.fds += fds or []

    def next(self) -> bytes | None:
        """The body of the next whole frame received, or None; ``ProtocolError`` for one over the limit
        (known from its head, before its body is read)."""
        if len(self.buffer) < HEAD.size:
            return None
        (length,) = HEAD.unpack_from(self.buffer)
        if length > self.limit:
            raise ProtocolError(f"{self.what}: a frame of {length} bytes; at most {self.limit}")
        end = HEAD.size + length
        if len(self.buffer) < end:
            return None
        body = bytes(self.buffer[HEAD.size : end])
        del self.buffer[:end]
        return body

    def fill(self, sock: socket.socket, *, fds: bool = False) -> bool:
        """Read what ``sock`` has (blocking per its timeout): False at the end of the stream (or a reset)."""
        try:
            if fds:
                data, got, _, _ = socket.recv_fds(sock, 1 << 20, 4)
            else:
                data, got = sock.recv(1 << 20), []
        except ConnectionResetError:
            return False
        self.feed(data, got)
        return bool(data)

    def receive(self, sock: socket.socket, deadline: float | None = None, *, fds: bool = False) -> bytes:
        """The next frame's body, waiting for it: ``ConnectionError`` when the stream ends first, ``TimeoutError`` at
        ``deadline`` (``time.monotonic``: the whole frame by then, however its bytes trickle in), else per the
        socket's own timeout."""
        while (body := self.next()) is None:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.what}: no whole message in time")
                sock.settimeout(left)
            if not self.fill(sock, fds=fds):
                raise ConnectionError(f"{self.what}: the peer closed the connection")
        return body

    def take_fds(self) -> list[int]:
        fds, self.fds = self.fds, []
        return fds
