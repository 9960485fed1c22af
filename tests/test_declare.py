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

import pytest

import runner_client as rc
from kvcached.config import DaemonConfig
from kvcached.daemon.declare import MAX_OPEN, READ_S
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
    """A declaring connection of the daemon's own user that sends one byte every 0.5 s: each byte well within
    any per-read timeout, the whole message never."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
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
        busy = [sock for sock in flood[MAX_OPEN * 2 :: 50] if b'"busy": true' in sock.recv(4096)]
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
                sock.sendall(json.dumps({"spec": spec(num_blocks=blocks).to_dict()}).encode() + b"\n")
        replies = [json.loads(sock.recv(4096).split(b"\n")[0]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    assert sorted(reply["accepted"] for reply in replies) == [False, True], replies
    refused = next(reply for reply in replies if not reply["accepted"])
    assert refused["field"] == "num_blocks" and "another declaration was accepted first" in refused["message"]
    taken = 20 if replies[0]["accepted"] else 24
    assert daemon.wait_ready()["spec"]["num_blocks"] == taken


def exchange(path: Path, raw: bytes) -> bytes:
    """Send ``raw`` on a declaring connection and read the reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(READ_S + 10)
        sock.connect(str(path))
        sock.sendall(raw)
        return sock.recv(4096)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"[" * 10000 + b"\n", b"nested too deep"),
        (b"[" * 100000 + b"\n", b"at most 16384 bytes"),
        (b'{"spec": 5}\n', b"must be a JSON object of CacheSpec fields; got int"),
        (b"\xff\xfe\n", b"not JSON"),
    ],
)
def test_a_malformed_declaration_is_refused_and_costs_only_itself(
    daemons: DaemonFactory, raw: bytes, message: bytes
) -> None:
    """A declaration nested deeper than the parser goes, longer than a message may be, or not a spec at all
    is refused to its sender, naming ``spec`` and what a declaration is; the daemon goes on waiting and
    takes the next declaration."""
    daemon = waiting(daemons)
    path = declare_socket_path(daemons.run_dir, daemon.instance)
    reply = exchange(path, raw)
    assert b'"accepted": false, "field": "spec"' in reply and message in reply, reply
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
