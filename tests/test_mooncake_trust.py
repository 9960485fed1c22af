"""What the distributed tier trusts: the Mooncake keeper checks every request an agent sends before a
pointer is made of it; with ``--mooncake-secret-file`` an object written by a client without the secret
is a miss. A real keeper on a real ``mooncake_master``; requests sent on its own socket; a forger that is
a plain Mooncake client of the same master."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import runner_client as rc
from kvcached.protocol.spec import CacheSpec
from kvcached.store.mooncake_link import Receiver, send
from tests.conftest import DaemonFactory, MooncakeMaster
from tests.test_mooncake_hosts import (
    GEOMETRY,
    Host,
    alive,
    assert_loads,
    keeper_pid,
    load_prefix,
    start_host,
    store_prefix,
)

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


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_descriptors_sent_with_frames_the_keeper_refuses_are_closed(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Fifty connections each passing four descriptors with a frame the keeper refuses (too long, not an
    object, cut short): the keeper holds none of them after, and serves on."""
    host = start_host(daemons, mooncake)
    keys, expected = store_prefix(host, 4, salt=201)
    pid = keeper_pid(host)
    before = open_fds(pid)
    r, w = os.pipe()
    try:
        for frame in [b"\xff\xff\xff\xff", b"\x02\x00\x00\x00[]", b"\x10\x00\x00\x00{"] * 17:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(30)
                sock.connect(str(host.run_dir() / f"{host.instance}.mooncake.sock"))
                socket.send_fds(sock, [frame], [r, w, r, w])
                sock.shutdown(socket.SHUT_WR)
                assert sock.recv(4096) == b""
    finally:
        os.close(r)
        os.close(w)
    deadline = time.monotonic() + 10
    while open_fds(pid) > before + 2 and time.monotonic() < deadline:  # (a closing session's thread may lag)
        time.sleep(0.05)
    assert open_fds(pid) <= before + 2, (before, open_fds(pid))
    assert keeper_pid(host) == pid
    assert_loads(host, keys, expected)


def test_a_keeper_out_of_descriptors_keeps_its_segment_and_serves_once_they_are_back(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """The keeper's open-file limit lowered to a few above what it holds, then connections held past it: the
    accepts that fail cost those connections only; the keeper (the same process) keeps its segment, and once
    they are closed the host's objects load byte for byte."""
    if os.geteuid() != 0:
        pytest.skip("needs root to lower another process's open-file limit")
    host = start_host(daemons, mooncake)
    keys, expected = store_prefix(host, 4, salt=202)
    pid = keeper_pid(host)
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    held: list[socket.socket] = []
    try:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (open_fds(pid) + 4, hard))
        for _ in range(12):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(host.run_dir() / f"{host.instance}.mooncake.sock"))
            held.append(sock)
        time.sleep(2)
        assert alive(pid), "the keeper exited when it ran out of descriptors"
    finally:
        for sock in held:
            sock.close()
        if alive(pid):
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    assert keeper_pid(host) == pid
    assert_loads(host, keys, expected)


FORGER = """
import socket, sys, time
from mooncake.store import MooncakeDistributedStore
from kvcached.protocol.spec import CacheSpec
from kvcached.store.base import ObjectIdentity, checksum
master, metadata, geometry, keys = sys.argv[1], sys.argv[2], eval(sys.argv[3]), sys.argv[4].split(",")
spec = CacheSpec(**geometry, storage_backend="mooncake")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
client = MooncakeDistributedStore()
assert client.setup(f"127.0.0.1:{port}", metadata, 16 << 20, 16 << 20, "tcp", "", master) == 0
for key in keys:
    for rank in (0, 1):
        identity = ObjectIdentity(spec.geometry_digest, rank, spec.block_bytes)
        payload = b"A" * spec.block_bytes
        header = identity.header(bytes.fromhex(key), checksum([memoryview(payload)]))
        assert client.put(f"kvcached/{spec.geometry_digest.hex()}/{key}/r{rank}", header + payload) == 0
print("forged", flush=True)
time.sleep(600)
"""


@contextmanager
def forged(master: MooncakeMaster, keys: list[bytes]) -> Iterator[None]:
    """Objects with a valid header and checksum, and the forger's bytes, under the names of ``keys``, put by
    a Mooncake client of the master that is no kvcached host (its segment holds them while it runs)."""
    args = [master.address, master.metadata, repr(GEOMETRY), ",".join(key.hex() for key in keys)]
    forger = subprocess.Popen([sys.executable, "-c", FORGER, *args], stdout=subprocess.PIPE, text=True)
    try:
        assert forger.stdout is not None and forger.stdout.readline().strip() == "forged"
        yield
    finally:
        forger.kill()
        forger.wait()


def secret_file(tmp_path: Path, mode: int = 0o600) -> Path:
    path = tmp_path / "mooncake.secret"
    path.write_text("a secret every host of this cluster shares\n")
    path.chmod(mode)
    return path


def test_with_a_secret_a_forged_object_is_a_miss(
    daemons: DaemonFactory, mooncake: MooncakeMaster, tmp_path: Path
) -> None:
    """Without a secret a forged object (valid header and xxh3, the forger's bytes) is served, as
    docs/mooncake.md warns; with ``--mooncake-secret-file`` on every host the hosts share their prefixes
    byte for byte and a forged object is a miss (and removed)."""
    secret = ["--mooncake-secret-file", str(secret_file(tmp_path))]
    a, b = start_host(daemons, mooncake, extra=tuple(secret)), start_host(daemons, mooncake, extra=tuple(secret))
    plain = start_host(daemons, mooncake)
    keys, expected = store_prefix(a, 4, salt=300)
    assert_loads(b, keys, expected)
    planted = rc.block_keys(list(range(400, 416)), 4)
    with forged(mooncake, planted):
        _, loaded, got = load_prefix(plain, planted)
        assert loaded == 4 and all(set(block) == {0x41} for block in got), "without a secret, forgeries load"
        assert load_prefix(b, planted)[1] == 0, "with the secret, a forged object is a miss"
    assert "not tagged with the store's secret" in b.daemon.log()
    assert_loads(b, keys, expected)


def test_a_secret_file_others_can_read_is_refused(
    daemons: DaemonFactory, mooncake: MooncakeMaster, tmp_path: Path
) -> None:
    path = secret_file(tmp_path, 0o644)
    args = [*mooncake.args(segment="8MiB"), "--mooncake-secret-file", str(path)]
    daemon = daemons.start(ranks=1, args=args)
    assert daemon.exit_code() == 4
    assert "--mooncake-secret-file" in daemon.log() and f"`chmod 600 {path}`" in daemon.log()
