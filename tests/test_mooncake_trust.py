"""What the distributed tier trusts: the Mooncake keeper checks every request an agent sends before a
pointer is made of it. A real keeper on a real ``mooncake_master``; requests sent on its own socket."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest

from kvcached.protocol.spec import CacheSpec
from kvcached.store.mooncake_link import Receiver, send
from tests.conftest import DaemonFactory, MooncakeMaster
from tests.test_mooncake_hosts import GEOMETRY, Host, alive, assert_loads, keeper_pid, start_host, store_prefix

BUFFER = 4096


def keeper_session(host: Host) -> tuple[socket.socket, Receiver]:
    """A connection to the host's keeper that has said hello with a batch buffer of ``BUFFER`` bytes."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(host.run_dir() / f"{host.instance}.mooncake.sock"))
    buffer = os.memfd_create("kvt-batch")
    os.ftruncate(buffer, BUFFER)
    try:
        send(sock, {"op": "hello"}, (buffer,))
    finally:
        os.close(buffer)
    receiver = Receiver(sock)
    assert receiver.receive()["ok"]
    for fd in receiver.take_fds():
        os.close(fd)
    return sock, receiver


def test_a_request_out_of_the_agents_buffer_is_refused_and_the_keeper_serves_on(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Gets and puts whose offsets or sizes leave the agent's buffer (past its end, negative, a size of
    zero, lists of the wrong length or type), names that are not strings, replicas out of range: each is
    refused with an error naming what is wrong, the keeper (same pid) serves on, and the host's objects
    load byte for byte afterwards."""
    host = start_host(daemons, mooncake)
    keys, expected = store_prefix(host, 8, salt=100)
    pid = keeper_pid(host)
    digest = CacheSpec(**GEOMETRY, storage_backend="mooncake").geometry_digest.hex()
    stored = f"kvcached/{digest}/{keys[0].hex()}/r0"
    requests: list[tuple[dict[str, Any], str]] = [
        ({"op": "get", "names": [stored], "offsets": [1 << 30], "sizes": [700]}, "do not lie in the 4096-byte buffer"),
        ({"op": "get", "names": [stored], "offsets": [-(1 << 20)], "sizes": [700]}, "do not lie in"),
        ({"op": "get", "names": [stored], "offsets": [4000], "sizes": [700]}, "do not lie in"),
        ({"op": "get", "names": [stored], "offsets": [0], "sizes": [0]}, "do not lie in"),
        ({"op": "get", "names": [stored, stored], "offsets": [0], "sizes": [700]}, "offsets: must be a list of 2"),
        ({"op": "get", "names": [stored], "offsets": ["0"], "sizes": [700]}, "offsets: must be a list of 1"),
        ({"op": "get", "names": [stored], "offsets": [0.5], "sizes": [700]}, "offsets: must be a list of 1"),
        ({"op": "put", "names": ["kvt/x"], "offsets": [1 << 30], "sizes": [4096], "replicas": 1}, "do not lie in"),
        ({"op": "put", "names": ["kvt/x"], "offsets": [0], "sizes": [4096], "replicas": 1 << 40}, "replicas: must be"),
        ({"op": "exists", "names": 5}, "names: must be a list of strings"),
        ({"op": "remove", "names": [[stored]]}, "names: must be a list of strings"),
        ({"op": "exists"}, "names: must be a list of strings"),
    ]
    sock, receiver = keeper_session(host)
    with sock:
        for request, why in requests:
            send(sock, request)
            reply = receiver.receive()
            assert reply["ok"] is False and why in reply["error"], (request, reply)
        send(sock, {"op": "exists", "names": [stored]})
        assert receiver.receive()["result"] == [1], "the keeper still answers this connection"
    assert alive(pid) and keeper_pid(host) == pid
    assert_loads(host, keys, expected)


@pytest.mark.parametrize("frame", [b"\x05\x00\x00\x00hello", b"\x02\x00\x00\x00[]", b"\xff\xff\xff\x7f"])
def test_a_frame_that_is_not_a_request_closes_only_its_connection(
    daemons: DaemonFactory, mooncake: MooncakeMaster, frame: bytes
) -> None:
    host = start_host(daemons, mooncake)
    keys, expected = store_prefix(host, 4, salt=200)
    pid = keeper_pid(host)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(host.run_dir() / f"{host.instance}.mooncake.sock"))
        sock.sendall(frame)
        assert sock.recv(4096) == b"", "the keeper closed the connection"
    assert alive(pid) and keeper_pid(host) == pid
    assert_loads(host, keys, expected)
