"""The control protocols' one frame (``kvcached.protocol.framing``) over real socket pairs: whole frames
however the bytes come, descriptors with them, a limit known from the head, a deadline for the whole
frame; and the one polling wait and end of a process (``kvcached.protocol.proc``)."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time

import pytest

from kvcached.protocol import framing
from kvcached.protocol.errors import ProtocolError
from kvcached.protocol.proc import end, start_time, until


def test_frames_come_whole_however_their_bytes_are_cut_and_bring_their_descriptors() -> None:
    left, right = socket.socketpair()
    with left, right:
        messages = [{"op": "hello", "n": n, "text": "x" * n} for n in (0, 1, 300, 70000)]
        data = b"".join(framing.frame(framing.encode(m)) for m in messages)
        reader = framing.Reader(framing.KEEPER, "test")
        got = []
        for at in range(0, len(data), 7):  # seven bytes at a time: heads and bodies cut anywhere
            reader.feed(data[at : at + 7])
            while (body := reader.next()) is not None:
                got.append(framing.decode(body, "test"))
        assert got == messages and reader.buffer == bytearray()
        r, w = os.pipe()
        try:
            framing.send(left, framing.encode({"op": "fd"}), (r,))
            reader = framing.Reader(framing.KEEPER, "test")
            assert framing.decode(reader.receive(right, fds=True), "test") == {"op": "fd"}
            (passed,) = reader.take_fds()
            os.write(w, b"through")
            assert os.read(passed, 16) == b"through"
            os.close(passed)
        finally:
            os.close(r)
            os.close(w)


def test_a_frame_over_its_limit_is_refused_from_its_head_and_garbage_is_named() -> None:
    reader = framing.Reader(framing.DECLARATION, "declaration")
    reader.feed(framing.HEAD.pack(framing.DECLARATION + 1))
    with pytest.raises(ProtocolError, match=f"at most {framing.DECLARATION}"):
        reader.next()
    for body, why in ((b"[" * 100000, "nested too deep"), (b"\xff", "not JSON"), (b"[1]", "JSON list, not an object")):
        with pytest.raises(ProtocolError, match=why):
            framing.decode(body, "declaration")


def test_a_trickling_peer_meets_the_deadline_of_the_whole_frame_and_an_end_mid_frame_is_named() -> None:
    left, right = socket.socketpair()
    stop = threading.Event()

    def trickle() -> None:
        left.sendall(framing.HEAD.pack(100))
        while not stop.wait(0.05):
            left.sendall(b" ")

    feeder = threading.Thread(target=trickle)
    feeder.start()
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            framing.Reader(framing.KEEPER, "test").receive(right, time.monotonic() + 0.5)
        assert time.monotonic() - started < 5
    finally:
        stop.set()
        feeder.join()
    left.sendall(framing.HEAD.pack(10) + b"abc")
    left.close()
    with right, pytest.raises(ConnectionError, match="closed"):
        framing.Reader(framing.KEEPER, "test").receive(right, time.monotonic() + 5)


def test_until_returns_the_first_true_value_or_the_last_and_end_kills_what_outlives_its_grace() -> None:
    calls: list[int] = []
    assert until(lambda: calls.append(1) or (len(calls) >= 3 and "ready"), 10, every=0.001) == "ready"
    assert until(lambda: 0, 0.05) == 0
    quick = subprocess.Popen(["sleep", "0.1"])
    stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 600"])
    started = time.monotonic()
    end([quick.pid, stubborn.pid], 1.0, child=True)
    assert 0.9 < time.monotonic() - started < 30
    assert start_time(quick.pid) is None and start_time(stubborn.pid) is None
    with pytest.raises(ChildProcessError):  # both reaped by end itself
        os.waitpid(stubborn.pid, os.WNOHANG)
