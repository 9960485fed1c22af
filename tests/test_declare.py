"""``--geometry engine``: the daemon holds its ranks until the engine's first runner declares the geometry,
allocates exactly that, refuses a different one by name, keeps it across a restart and a kill."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import runner_client as rc
from kvcached.config import DaemonConfig
from kvcached.daemon.declarations import MAX_OPEN, READ_S
from kvcached.protocol import framing
from kvcached.protocol.declare import declare_socket_path
from kvcached.protocol.errors import InvalidConfig
from kvcached.status import awaits_geometry, read_status
from tests.conftest import Daemon, DaemonFactory, shm_entries


def spec(**changes: object) -> rc.CacheSpec:
    fields: dict[str, object] = dict(
        num_layers=3, kv_heads=2, head_dim=16, block_size=4, num_blocks=20, num_cpu_blocks=6
    )
    fields.update(changes)
    return rc.CacheSpec(**fields)  # type: ignore[arg-type]


def waiting(daemons: DaemonFactory, *args: str) -> Daemon:
    daemon = daemons.start(ranks=2, small=False, args=["--geometry", "engine", *args])
    daemon.wait_state("EMPTY")
    return daemon


def test_the_first_declaration_is_allocated_exactly(daemons: DaemonFactory) -> None:
    """No geometry given: the ranks wait (EMPTY, the note says why) until a runner declares its spec; then
    every rank holds exactly that spec and the runner attaches."""
    daemon = waiting(daemons)
    status = read_status(daemon.instance)
    assert "declare the geometry" in status["note"] and [r["state"] for r in status["ranks"]] == ["EMPTY", "EMPTY"]
    with rc.initialize_kv_cache(spec(), 1, instance=daemon.instance, timeout=30) as cache:
        assert cache.owner == "daemon" and cache.key_caches[0].shape == (20, 2, 4, 16)
    status = daemon.wait_ready()
    assert status["spec"]["num_blocks"] == 20 and status["spec"]["num_layers"] == 3


def test_a_different_declaration_is_refused_by_name_and_an_equal_one_adopts(daemons: DaemonFactory) -> None:
    daemon = waiting(daemons)
    instance = daemon.instance
    rc.initialize_kv_cache(spec(), 0, instance=instance, timeout=30).close()
    with pytest.raises(rc.CacheLayoutMismatch) as refused:
        rc.initialize_kv_cache(spec(num_blocks=21), 1, instance=instance, timeout=30)
    assert refused.value.field == "num_blocks" and "21" in str(refused.value)
    said = str(refused.value)  # which process holds which value
    assert "20 in the daemon's" in said and f"21 in the spec this process (pid {os.getpid()}) declares" in said
    rc.initialize_kv_cache(spec(), 1, instance=instance, timeout=30).close()


def test_a_declaration_the_daemon_cannot_hold_is_refused_and_it_waits_on(daemons: DaemonFactory) -> None:
    """A spec for which the runner owns the cache (no CPU pool, no store, mixed) is refused naming
    num_cpu_blocks; the daemon goes on waiting and takes the next declaration."""
    daemon = waiting(daemons)
    instance = daemon.instance
    with pytest.raises(rc.CacheLayoutMismatch) as refused:
        rc.wait_until_ready(instance, 0, timeout=10, declare=spec(num_cpu_blocks=0))
    assert refused.value.field == "num_cpu_blocks" and "the runner owns the cache" in str(refused.value)
    assert read_status(instance)["ranks"][0]["state"] == "EMPTY"
    with pytest.raises(rc.CacheLayoutMismatch) as refused:  # no pool, and a store this daemon does not have
        rc.wait_until_ready(instance, 0, timeout=10, declare=spec(num_cpu_blocks=0, storage_backend="file"))
    assert refused.value.field == "storage_backend" and "this daemon has none" in str(refused.value)
    rc.initialize_kv_cache(spec(), 0, instance=instance, timeout=30).close()


@pytest.mark.parametrize("how", ["restart", "kill"])
def test_the_declared_geometry_survives_a_restart_and_a_kill(daemons: DaemonFactory, how: str) -> None:
    """``kvcached restart``, or kill -9 and ``kvcached start``, with the same ``--geometry engine`` command:
    the memory is adopted with the geometry declared before, and a runner's equal declaration attaches."""
    daemon = waiting(daemons)
    instance = daemon.instance
    with rc.initialize_kv_cache(spec(), 0, instance=instance, timeout=30) as cache:
        cache.key_caches[2][19, 1, 3, 15] = 7
    daemon.wait_ready()
    if how == "restart":
        assert daemons.cli("restart", "--instance", instance).returncode == 0
    else:
        daemon.kill9()
        daemon = daemons.start(instance, ranks=2, small=False, args=["--geometry", "engine"])
    status = daemon.wait_ready()
    assert "adopted" in status["note"] and status["spec"]["num_blocks"] == 20
    with rc.initialize_kv_cache(spec(), 0, instance=instance, timeout=30) as cache:
        assert cache.key_caches[2][19, 1, 3, 15] == 7


def test_a_restart_while_waiting_waits_again_and_a_stop_leaves_nothing(daemons: DaemonFactory) -> None:
    daemon = waiting(daemons)
    restarted = daemons.cli("restart", "--instance", daemon.instance)
    assert restarted.returncode == 0 and "waiting for the engine" in restarted.stdout, restarted
    assert awaits_geometry(read_status(daemon.instance))
    assert daemon.stop() == 0
    assert shm_entries(daemon.instance) == []


def test_geometry_options_with_geometry_engine_are_refused_by_name() -> None:
    with pytest.raises(InvalidConfig) as refused:
        DaemonConfig.build({"geometry": "engine", "num_blocks": "64"}, environ={})
    assert refused.value.source == "--num-blocks" and "declared by the engine" in refused.value.message
    config = DaemonConfig.build({"geometry": "engine", "storage_backend": "file"}, environ={})
    assert config.geometry == "engine" and config.store.backend == "file"


class Dribbler:
    """A declaring connection of the daemon's own user that sends the head of a 300-byte frame, then one byte
    every 0.5 s: each byte well within any per-read timeout, the whole message never."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.sock.sendall(framing.HEAD.pack(300))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._dribble, daemon=True)
        self.thread.start()

    def _dribble(self) -> None:
        while not self.stop.wait(0.5):
            try:
                self.sock.send(b" ")
            except OSError:
                return

    def answer(self, timeout: float) -> bytes:
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(4096)
        except OSError:
            return b""

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def test_a_declarer_that_dribbles_costs_only_itself(daemons: DaemonFactory) -> None:
    """A connection that sends its declaration a byte at a time never holds the waiting daemon: it has
    READ_S for its whole message, then is refused and closed; meanwhile a runner's declaration is accepted
    and attaches, and ``kvcached stop`` stops a daemon that still has such a connection."""
    daemon = waiting(daemons)
    path = declare_socket_path(daemons.run_dir, daemon.instance)
    dribbler = Dribbler(path)
    try:
        assert b"no whole declaration within 2s" in dribbler.answer(READ_S + 10)
    finally:
        dribbler.close()
    assert read_status(daemon.instance)["ranks"][0]["state"] == "EMPTY"
    dribbler = Dribbler(path)
    try:
        time.sleep(0.2)
        with rc.initialize_kv_cache(spec(), 0, instance=daemon.instance, timeout=20) as cache:
            assert cache.key_caches[0].shape == (20, 2, 4, 16)
    finally:
        dribbler.close()
    other = waiting(daemons)
    dribbler = Dribbler(declare_socket_path(daemons.run_dir, other.instance))
    try:
        time.sleep(0.2)
        assert daemons.cli("stop", "--instance", other.instance, timeout=30).returncode == 0
        assert other.exit_code(30) == 0
    finally:
        dribbler.close()


def test_a_flood_of_silent_declarers_costs_only_their_connections(daemons: DaemonFactory) -> None:
    """1,500 connections that send nothing (past 1,024 descriptors, where select() gives up): the daemon
    serves MAX_OPEN of them side by side, answers the rest "busy", and then accepts a runner's declaration."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1600:
        pytest.skip(f"needs 1,600 descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1600), hard))
    daemon = waiting(daemons)
    path = declare_socket_path(daemons.run_dir, daemon.instance)
    flood: list[socket.socket] = []
    try:
        for _ in range(1500):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            flood.append(sock)
            sock.connect(str(path))  # blocking: waits while the daemon's backlog is full
            sock.settimeout(5)
        time.sleep(0.5)
        assert daemon.proc.poll() is None, daemon.log()[-2000:]
        busy = [sock for sock in flood[MAX_OPEN * 2 :: 50] if reply_of(sock.recv(4096)).get("busy") is True]
        assert busy, "connections past MAX_OPEN are answered busy"
    finally:
        for sock in flood:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with rc.initialize_kv_cache(spec(), 0, instance=daemon.instance, timeout=30) as cache:
        assert cache.key_caches[0].shape == (20, 2, 4, 16)


@contextlib.contextmanager
def frozen(daemon: Daemon, seconds: float) -> Iterator[None]:
    """The daemon's supervisor stopped (SIGSTOP) while the block runs, then for the rest of ``seconds``, then
    resumed: as a loaded host leaves it unscheduled."""
    os.kill(daemon.pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        yield
        time.sleep(max(0.0, seconds - (time.monotonic() - started)))
    finally:
        os.kill(daemon.pid, signal.SIGCONT)


def test_forty_declarers_of_one_spec_while_the_supervisor_is_not_scheduled_all_attach(daemons: DaemonFactory) -> None:
    """40 runners declare the same spec while the supervisor is stopped for a second: past the 32 connections
    it serves at once the rest are told busy, never refused, ask again within their deadline, and all 40 find
    their rank READY."""
    daemon = waiting(daemons)
    errors: list[BaseException] = []

    def declare(rank: int) -> None:
        try:
            rc.wait_until_ready(daemon.instance, rank, timeout=60, declare=spec())
        except BaseException as exc:  # the test's own verdict: any error fails it
            errors.append(exc)

    threads = [threading.Thread(target=declare, args=(i % 2,)) for i in range(40)]
    with frozen(daemon, 1.0):
        for thread in threads:
            thread.start()
    for thread in threads:
        thread.join(90)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    assert [r["state"] for r in read_status(daemon.instance)["ranks"]] == ["READY", "READY"]


def test_two_different_declarations_at_once_one_accepted_one_refused_on_the_socket(daemons: DaemonFactory) -> None:
    """Two declarations of different specs sent while the supervisor is not scheduled reach it together: on
    the raw socket exactly one is answered accepted and the other refused, naming the field that differs."""
    daemon = waiting(daemons)
    path = declare_socket_path(daemons.run_dir, daemon.instance)
    socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    try:
        with frozen(daemon, 0.5):
            for sock, blocks in zip(socks, (20, 24), strict=True):
                sock.settimeout(30)
                sock.connect(str(path))
                framing.send(sock, framing.encode({"spec": spec(num_blocks=blocks).to_dict()}))
        replies = [reply_of(sock.recv(4096)) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    assert sorted(reply["accepted"] for reply in replies) == [False, True], replies
    refused = next(reply for reply in replies if not reply["accepted"])
    assert refused["field"] == "num_blocks" and "another declaration was accepted first" in refused["message"]
    taken = 20 if replies[0]["accepted"] else 24
    assert daemon.wait_ready()["spec"]["num_blocks"] == taken


def reply_of(data: bytes) -> dict[str, Any]:
    """The daemon's answer, read as its own reader would (one frame of JSON)."""
    reader = framing.Reader(framing.DECLARATION, "declaration")
    reader.feed(data)
    body = reader.next()
    assert body is not None, data
    return framing.decode(body, "declaration")


def exchange(path: Path, raw: bytes) -> bytes:
    """Send ``raw`` on a declaring connection, close its sending side and read the reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(READ_S + 10)
        sock.connect(str(path))
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)
        return sock.recv(4096)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (framing.frame(b"[" * 10000), "nested too deep"),
        (framing.HEAD.pack(100000) + b"[" * 4096, "a frame of 100000 bytes; at most 16384"),
        (b'{"spec": {"num_layers": 2}}\n', "a declaration is one frame (a u32 length, then JSON"),
        (framing.frame(b'{"spec": 5}'), "must be a JSON object of CacheSpec fields; got int"),
        (framing.frame(b"\xff\xfe"), "not JSON"),
        (framing.frame(b'{"spec": {"num_layers"'), "not JSON"),
        (framing.HEAD.pack(300) + b"{", "the connection ended before a whole declaration"),
    ],
)
def test_a_malformed_declaration_is_refused_and_costs_only_itself(
    daemons: DaemonFactory, raw: bytes, message: str
) -> None:
    """A declaration nested deeper than the parser goes, longer than a message may be, a line of JSON (not a
    frame), cut short by the end of its connection, or not a spec at all is refused to its sender, naming
    ``spec`` and what a declaration is; the daemon goes on waiting and takes the next declaration."""
    daemon = waiting(daemons)
    path = declare_socket_path(daemons.run_dir, daemon.instance)
    reply = reply_of(exchange(path, raw))
    assert (reply["accepted"], reply["field"]) == (False, "spec") and message in reply["message"], reply
    assert daemon.proc.poll() is None, daemon.log()[-3000:]
    assert read_status(daemon.instance)["ranks"][0]["state"] == "EMPTY"
    with rc.initialize_kv_cache(spec(), 0, instance=daemon.instance, timeout=20) as cache:
        assert cache.key_caches[0].shape == (20, 2, 4, 16)


def test_stop_keep_of_a_daemon_waiting_for_the_geometry_says_there_was_nothing_to_keep(daemons: DaemonFactory) -> None:
    """A daemon still waiting for the engine's declaration holds no cache: `stop --keep` stops it and says
    so, exit 0 (a script's `stop --keep && ...` goes on), and leaves nothing in /dev/shm."""
    daemon = waiting(daemons)
    done = daemons.cli("stop", "--keep", "--instance", daemon.instance, timeout=30)
    assert done.returncode == 0 and "waiting for the engine's geometry and held no cache" in done.stdout, done
    assert daemon.exit_code(30) == 0
    assert shm_entries(daemon.instance) == []


def test_a_declaration_of_millions_of_layers_is_refused_by_name_and_costs_nothing(daemons: DaemonFactory) -> None:
    """A spec of ten million layers (small in bytes: one head of one element a block) is refused naming
    ``num_layers`` at once: the daemon builds nothing per layer; a count of thousands of digits is refused by
    name too; the daemon stays up, and takes the next declaration."""
    daemon = waiting(daemons)
    path = declare_socket_path(daemons.run_dir, daemon.instance)
    for field in ("num_layers", "mtp_layers"):
        huge = {**spec(kv_heads=1, head_dim=1, block_size=1, num_blocks=1).to_dict(), field: 10**7}
        started = time.monotonic()
        reply = reply_of(exchange(path, framing.frame(json.dumps({"spec": huge}).encode())))
        assert time.monotonic() - started < 5 and reply["field"] == field and "at most" in reply["message"], reply
    for field in ("num_blocks", "num_cpu_blocks", "head_dim"):  # 4,300 digits: JSON, but a total past printing
        raw = json.dumps({"spec": {**spec().to_dict(), field: "N"}}).replace('"N"', "9" * 4300)
        reply = reply_of(exchange(path, framing.frame(raw.encode())))
        assert reply["field"] == field and "2**63 - 1" in reply["message"], reply
    assert daemon.proc.poll() is None
    with rc.initialize_kv_cache(spec(), 0, instance=daemon.instance, timeout=30) as cache:
        assert cache.key_caches[0].shape == (20, 2, 4, 16)


def test_a_full_listening_queue_is_busy_and_the_declarer_asks_again(daemons: DaemonFactory) -> None:
    """The supervisor not scheduled and its listening queue full (65 connections): a runner's declaration finds
    no room, which is busy, not an error; it asks again and attaches once the daemon runs."""
    daemon = waiting(daemons)
    path = declare_socket_path(daemons.run_dir, daemon.instance)
    held: list[socket.socket] = []
    errors: list[BaseException] = []

    def attach() -> None:
        try:
            rc.initialize_kv_cache(spec(), 0, instance=daemon.instance, timeout=30).close()
        except BaseException as exc:  # the test's verdict
            errors.append(exc)

    try:
        with frozen(daemon, 2.0):
            for _ in range(80):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.setblocking(False)
                try:
                    sock.connect(str(path))
                except BlockingIOError:
                    sock.close()
                    break
                held.append(sock)
            runner = threading.Thread(target=attach)
            runner.start()
            time.sleep(0.5)
            assert errors == [], "a full queue raised instead of asking again"
        runner.join(40)
    finally:
        for sock in held:
            sock.close()
    assert not runner.is_alive() and errors == []


def test_a_neighbour_reconnecting_silent_connections_cannot_hold_the_socket(daemons: DaemonFactory) -> None:
    """A process of the daemon's user that keeps as many silent connections open as the daemon serves, and
    opens a new one each time one is closed: a runner's declaration still gets in (the silent ones make room
    for a declarer that speaks) and attaches well within its deadline."""
    daemon = waiting(daemons)
    path = str(declare_socket_path(daemons.run_dir, daemon.instance))
    stop = threading.Event()

    def loris() -> None:
        open_: list[socket.socket] = []
        while not stop.is_set():
            open_ = [s for s in open_ if s.fileno() >= 0 and not _closed_by_peer(s)]
            while len(open_) < MAX_OPEN + 8 and not stop.is_set():
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(path)
                except OSError:
                    sock.close()
                    break
                open_.append(sock)
            time.sleep(0.01)
        for sock in open_:
            sock.close()

    attacker = threading.Thread(target=loris, daemon=True)
    attacker.start()
    try:
        time.sleep(1.0)
        started = time.monotonic()
        with rc.initialize_kv_cache(spec(), 0, instance=daemon.instance, timeout=20) as cache:
            assert cache.key_caches[0].shape == (20, 2, 4, 16)
        assert time.monotonic() - started < 10
    finally:
        stop.set()
        attacker.join(10)


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the daemon answered or closed ``sock`` (then it is closed here too)."""
    try:
        sock.recv(4096, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    except OSError:
        pass
    sock.close()
    return True


def test_a_wait_never_outlasts_its_deadline_on_a_daemon_that_does_not_answer(daemons: DaemonFactory) -> None:
    """The supervisor stopped: a declaring wait of 1 s raises CacheNotReady after about 1 s, not after the
    five seconds one declaration may take."""
    daemon = waiting(daemons)
    with frozen(daemon, 0.0):
        started = time.monotonic()
        with pytest.raises(rc.CacheNotReady):
            rc.wait_until_ready(daemon.instance, 0, timeout=1.0, declare=spec())
        assert time.monotonic() - started < 3
