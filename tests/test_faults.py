"""Legitimate long work, hostile neighbours and broken parts: each costs at most the task it hit.

One test per case found by trying the daemon as a hostile tester would; each docstring names its kind:

* why 1: legitimate long work or a stalled part (a long task, a hung worker, a frozen master or
  supervisor, clients that never read, a FIFO in the store) costs at most the task it hit;
* why 2: an object another user planted under the instance's names is refused;
* why 3: flow control: pipelined tasks, frozen sends, idle connections and parked frames are bounded;
* why 4: file store faults (a full disk, a failed write-through, foreign objects, a lost directory);
* why 5: the run directory and its lock file are never followed through a symlink;
* why 6: an operator gets an error and an exit status, never a traceback;
* why 7: smaller sharp edges of the CLI and the client;
* why 8: the suite runs beside another copy of itself.

Everything is real: daemon processes, SIGSTOP/SIGKILL, a real Mooncake master, a real tmpfs for a full
disk, other uids (as root; skipped otherwise, saying so).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import posix_ipc
import pytest

import runner_client as rc
from kvcached.daemon.store_agent import ABANDON_AFTER
from kvcached.protocol.control import ControlBlock
from kvcached.protocol.messages import MAX_PAYLOAD, REQUEST, REQUEST_MAGIC, Op, request
from kvcached.protocol.names import control_name, task_socket_path
from kvcached.status import read_status
from tests.conftest import (
    Daemon,
    DaemonFactory,
    MooncakeMaster,
    arena_digests,
    availability,
    remove_entries,
    run_runner,
    runner_result,
    shm_entries,
    unique_instance,
)
from tests.helpers.procs import Proc, descendants, frozen, halt
from tests.test_service import as_user

GEOMETRY = dict(num_layers=2, kv_heads=2, head_dim=16, block_size=4)
PLUGIN = {"KVCACHED_PLUGINS": "tests.plugins.memstore"}


def geometry(num_blocks: int = 8, num_cpu_blocks: int = 4) -> list[str]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in GEOMETRY.items()]
    return [*flags, f"--num-blocks={num_blocks}", f"--num-cpu-blocks={num_cpu_blocks}"]


def spec(num_blocks: int = 8, num_cpu_blocks: int = 4) -> rc.CacheSpec:
    return rc.CacheSpec(**GEOMETRY, num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks)  # type: ignore[arg-type]


def keys(n: int, salt: str = "") -> list[bytes]:
    return rc.block_keys(list(range(n * 4)), 4, extra=salt or None)


def pids(instance: str) -> list[int]:
    return [r["pid"] for r in read_status(instance)["ranks"]]


def states(instance: str) -> list[str]:
    return [r["state"] for r in read_status(instance)["ranks"]]


def until(check: Any, timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.02)


def fill(cache: rc.KVCache, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for t in cache.key_caches + cache.value_caches:
        raw = t.view(np.uint8)
        raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)


def hello(sock: socket.socket, generation: str) -> None:
    sock.sendall(request(Op.HELLO, 1, json.dumps({"generation": generation}).encode()))


def needs_root(why: str) -> None:
    if os.geteuid() != 0:
        pytest.skip(f"needs root: {why}")


# -- why 1: the hang detector destroyed every rank's cache ----------------------------------------------


def test_a_store_far_longer_than_the_timeouts_completes_while_the_daemon_stays_up(daemons: DaemonFactory) -> None:
    """Why 1: one valid store that takes several times the worker timeout and twelve times the store timeout
    (a slow store, 0.1 s an object, 30 objects) completes; the worker is never taken for hung; the daemon
    stays up. The timeouts are short so that the task need not be long: what counts is the ratio."""
    env = daemons.env(**PLUGIN)
    args = [*geometry(num_blocks=32), "--storage-backend", "testmem", "--testmem-delay", "0.1"]
    daemon = daemons.start(ranks=1, args=[*args, "--worker-timeout", "1", "--store-timeout", "0.25"], env=env)
    daemon.wait_ready()
    before = pids(daemon.instance)
    started = time.monotonic()
    with rc.CacheTasks(daemon.instance, timeout=180) as tasks:
        result = tasks.store(0, list(range(30)), keys(30))
        assert tasks.lookup(keys(30)) == 30
    assert result.blocks == 30 and time.monotonic() - started >= 3
    assert pids(daemon.instance) == before and states(daemon.instance) == ["READY"]
    assert "killing rank worker" not in daemon.log()


def test_a_swap_far_longer_than_the_worker_timeout_completes_while_the_daemon_stays_up(daemons: DaemonFactory) -> None:
    """Why 1: a valid swap that takes several times the worker timeout (12 runs of ids, each step slowed to
    0.25 s by fault injection, as a huge swap on a loaded host is) completes; the worker reports progress
    at every step and is never taken for hung. The numpy path, whose steps are runs of ids: the native
    path's steps are chunks of ``STEP_BYTES`` (a handful here; tests/test_copy.py checks it marks progress
    per chunk)."""
    env = daemons.env(KVCACHED_FAULT="copy-step:sleep=0.25", KVCACHED_NATIVE_COPY="0")
    args = [*geometry(num_blocks=64, num_cpu_blocks=32), "--worker-timeout", "1"]
    daemon = daemons.start(ranks=1, args=args, env=env)
    daemon.wait_ready()
    before = pids(daemon.instance)
    started = time.monotonic()
    with rc.CacheTasks(daemon.instance, timeout=180) as tasks:
        result = tasks.swap_out(0, list(range(0, 24, 2)), list(range(12)))  # every id its own run
    assert result.blocks == 12 and time.monotonic() - started >= 3
    assert pids(daemon.instance) == before and states(daemon.instance) == ["READY"]
    assert "killing rank worker" not in daemon.log()


def test_a_hung_worker_is_replaced_on_the_same_memory(daemons: DaemonFactory) -> None:
    """Why 1: a worker that truly hangs (SIGSTOP) is killed after --worker-timeout and replaced on the same
    arenas: the rank is READY again, the device tier and CPU pool are byte for byte what they were, tasks
    are served."""
    daemon = daemons.start(ranks=2, args=["--worker-timeout", "2"])
    status = daemon.wait_ready()
    with rc.initialize_kv_cache(spec(), 1, instance=daemon.instance) as cache, rc.CacheTasks(daemon.instance) as tasks:
        fill(cache, 1)
        tasks.swap_out(1, [1, 2], [0, 1])
        digests = arena_digests(daemon.instance)
        halt(status["ranks"][1]["pid"])
        until(lambda: pids(daemon.instance)[1] != status["ranks"][1]["pid"] and states(daemon.instance)[1] == "READY")
        assert arena_digests(daemon.instance) == digests
        tasks.swap_in(1, [0, 1], [5, 6])
        assert np.array_equal(cache.key_caches[0][5], cache.key_caches[0][1])
    assert "no progress for" in daemon.log() and "rank recovered" in daemon.log()


def test_kill9_of_a_worker_mid_task_keeps_every_byte(daemons: DaemonFactory) -> None:
    """Acceptance: kill -9 of one worker mid-task (a slow store reading the device tier): the rank is READY
    again within 2 s, the sha256 of its device tier and CPU pool unchanged; the task in flight fails with
    TaskLost, the next ones are served."""
    env = daemons.env(**PLUGIN)
    args = [*geometry(num_blocks=64), "--storage-backend", "testmem", "--testmem-delay", "0.2"]
    daemon = daemons.start(ranks=2, args=args, env=env)
    status = daemon.wait_ready()
    with (
        rc.initialize_kv_cache(spec(64), 1, instance=daemon.instance) as cache,
        rc.CacheTasks(daemon.instance) as tasks,
    ):
        fill(cache, 2)
        tasks.swap_out(1, [1, 2, 3], [0, 1, 2])
        digests = arena_digests(daemon.instance)
        handle = tasks.submit(tasks.store, 1, list(range(40)), keys(40))
        time.sleep(1.0)  # a few objects into an 8-second task
        killed = time.monotonic()
        os.kill(status["ranks"][1]["pid"], signal.SIGKILL)
        with pytest.raises(rc.TaskLost) as info:
            handle.result()
        assert info.value.rank == 1 and "replaced on the same memory" in str(info.value)
        until(lambda: states(daemon.instance)[1] == "READY" and pids(daemon.instance)[1] != status["ranks"][1]["pid"])
        assert time.monotonic() - killed < 2.0
        assert arena_digests(daemon.instance) == digests
        assert tasks.swap_in(1, [0], [7]).blocks == 1
    assert read_status(daemon.instance)["alive"]


def test_a_frozen_mooncake_master_fails_only_store_tasks(daemons: DaemonFactory, mooncake: MooncakeMaster) -> None:
    """Why 1 (and the README's promise): a Mooncake master frozen (SIGSTOP) for over three times the worker timeout
    and past the point where a stuck store agent is given up (``store_agent.ABANDON_AFTER`` store timeouts)
    fails store tasks, with StoreUnavailable, within the store timeout; swaps go on; every rank stays READY
    on the same worker; status says the store unavailable from the first call the master held (its agent,
    held, sends nothing); once the master is back, store tasks work again and the store is available."""
    master = mooncake
    assert master.proc is not None
    frozen_s = 3.5
    assert frozen_s > ABANDON_AFTER * 0.5  # the store timeout below
    try:
        args = [*geometry(), *master.args(), "--store-timeout", "0.5", "--worker-timeout", "1"]
        daemon = daemons.start(ranks=2, args=args)
        daemon.wait_ready()
        before = pids(daemon.instance)

        with rc.CacheTasks(daemon.instance, timeout=30) as tasks:
            until(lambda: _stores(tasks, 1), timeout=60, what="the store connected (the keeper starts meanwhile)")
            assert availability(daemon.instance) == [True, True]
            halt(master.proc.pid)
            frozen_at = time.monotonic()
            started = time.monotonic()
            with pytest.raises(rc.StoreUnavailable, match="without progress"):
                tasks.lookup(keys(2))  # held by the frozen master past the store timeout
            assert time.monotonic() - started < 5
            # The held agent sends nothing (its last idle check said available): the call it is held in says.
            assert availability(daemon.instance) == [False, False]
            with pytest.raises(rc.StoreUnavailable):
                tasks.store(None, [2], keys(2)[1:])
            while time.monotonic() - frozen_at < frozen_s:
                assert tasks.swap_out(None, [3], [1]).blocks == 1
                with pytest.raises(rc.StoreUnavailable):
                    tasks.lookup(keys(1))
                assert states(daemon.instance) == ["READY", "READY"] and pids(daemon.instance) == before
                time.sleep(0.5)
            master.proc.send_signal(signal.SIGCONT)
            until(lambda: _stores(tasks, 4), timeout=60, what="store tasks after the master thawed")
            until(lambda: availability(daemon.instance) == [True, True], timeout=30, what="the store available again")
        assert pids(daemon.instance) == before
        assert "has not returned for" in daemon.log()  # a stuck agent was given up and replaced
    finally:
        if master.proc is not None:
            master.proc.send_signal(signal.SIGCONT)


def test_a_store_agent_replaced_while_the_master_is_frozen_costs_nothing_once_it_answers(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """The master frozen while no task runs. Rank 1, idle: its store shows unavailable within seconds (the keeper's
    check of the master is held) and its store tasks fail at once, not after the store timeout. Rank 0: its store
    agent killed meanwhile; Mooncake cannot unregister its buffer (nor register its successor's) while the master
    is frozen, and keeps those regions registered for good: a buffer mapped there again was refused forever, the
    store unavailable until a final stop. Once the master answers, store tasks sent without a pause (no idle
    second in which an agent would hear the master is back) work on both ranks at once, and again after the next
    agent is killed (its successor's buffer mapped where the first's was); the log said when the store became
    unavailable and available again. Meanwhile another daemon killed -9 and its control block removed (its
    instance gone for good): its keeper quits within seconds, the master frozen all the while (a check of the
    master that it holds is not where the keeper looks for its instance, and its last unmount waits 2 s at most)."""
    assert mooncake.proc is not None
    args = [*geometry(), *mooncake.args(), "--store-timeout", "2"]
    daemon, gone = daemons.start(ranks=2, args=args), daemons.start(ranks=1, args=args)
    daemon.wait_ready()
    keeper_log = daemons.run_dir / f"{daemon.instance}.mooncake.log"
    with rc.CacheTasks(daemon.instance, timeout=30) as tasks:
        until(lambda: _stores(tasks, 1), timeout=60, what="the store connected")
        until(lambda: availability(gone.instance) == [True], timeout=60, what="the other daemon's store connected")
        (keeper,) = keepers_of(gone.instance)
        worker = pids(daemon.instance)[0]
        (agent,) = (int(pid) for pid in Path(f"/proc/{worker}/task/{worker}/children").read_text().split())
        with frozen(mooncake.proc.pid):
            os.kill(agent, signal.SIGKILL)
            gone.kill9()
            remove_entries(gone.instance)
            until(lambda: availability(daemon.instance) == [False, False], timeout=15, what="an idle store down")
            began = time.monotonic()
            with pytest.raises(rc.StoreUnavailable, match="does not answer its keeper's checks"):
                tasks.store(1, [2], keys(2)[1:])
            assert time.monotonic() - began < 1.5  # not the store timeout: the keeper found the master down
            until(lambda: "could not unregister" in keeper_log.read_text(), timeout=60, what="the old buffer held")
            until(lambda: not keeper.alive(), timeout=20, what="the keeper of an instance gone, its master frozen")
        # A task every 20 ms from the thaw on: no idle second in which an agent would hear the master is back.
        until(lambda: _stores(tasks, 2), timeout=30, what="store tasks once the master answers")
        (agent,) = (int(pid) for pid in Path(f"/proc/{worker}/task/{worker}/children").read_text().split())
        os.kill(agent, signal.SIGKILL)  # its successor's buffer is mapped where the first agent's was
        until(lambda: _stores(tasks, 3), timeout=30, what="store tasks with the next agent")
    until(lambda: availability(daemon.instance) == [True, True], timeout=30, what="the store available again")
    assert pids(daemon.instance)[0] == worker
    log = daemon.log()
    assert "attention store unavailable" in log and "attention store available again" in log


def _stores(tasks: rc.CacheTasks, block: int) -> bool:
    """Whether block ``block`` is stored under the last of ``keys(block)`` (False while the store does not answer)."""
    try:
        return tasks.store(None, [block], keys(block)[block - 1 :]).blocks == 1
    except rc.StoreUnavailable:
        return False


def test_a_frozen_mooncake_master_at_start_does_not_hold_the_ranks(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Why 1: a Mooncake master frozen while two daemons start: the ranks are READY anyway (their store is
    "connecting", UNAVAILABLE in status, the keeper held in its setup), store tasks fail with
    StoreUnavailable, and work once the master answers. Nothing left behind: `kvcached stop` (for good) of
    the other daemon while the master still does not answer leaves no keeper of it running (its launcher
    ends it once the instance is gone)."""
    args = [*geometry(), *mooncake.args(), "--store-timeout", "1"]
    assert mooncake.proc is not None
    with frozen(mooncake.proc.pid):
        daemon, gone = daemons.start(ranks=2, args=args), daemons.start(ranks=2, args=args)
        for started in (daemon, gone):
            started.wait_ready(timeout=30)
            until(lambda s=started: len(keepers_of(s.instance)) == 2, timeout=30, what="a keeper and its launcher")
            assert availability(started.instance) == [False, False]
        tasks = rc.CacheTasks(daemon.instance, timeout=30)
        with pytest.raises(rc.StoreUnavailable):
            tasks.store(None, [1], keys(1))
        assert tasks.swap_out(None, [1], [1]).blocks == 1
        stopped = daemons.cli("stop", "--instance", gone.instance)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        until(lambda: not keepers_of(gone.instance), timeout=30, what="no keeper once the instance is gone")
    with tasks:
        until(lambda: _stores(tasks, 1), timeout=90, what="store tasks once the master answers")


def keepers_of(instance: str) -> list[Proc]:
    """The Mooncake keeper processes of ``instance`` (a starting keeper's launcher among them)."""
    named = f'"instance": "{instance}"'
    return [p for p in descendants(1).values() if "kvcached.store.mooncake_keeper" in p.command and named in p.command]


def test_a_paused_supervisor_changes_nothing(daemons: DaemonFactory) -> None:
    """Why 1: the supervisor paused (SIGSTOP, a debugger) for more than twice the worker timeout and resumed:
    the workers served all along, no worker is taken for hung afterwards (looked at for longer than the
    timeout), every rank READY on the same worker."""
    daemon = daemons.start(ranks=2, args=["--worker-timeout", "1"])
    daemon.wait_ready()
    before = pids(daemon.instance)
    with rc.CacheTasks(daemon.instance) as tasks:
        halt(daemon.pid)
        try:
            paused = time.monotonic()
            while time.monotonic() - paused < 2.5:
                assert tasks.swap_out(None, [1], [1]).blocks == 1
                time.sleep(0.25)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        time.sleep(1.5)  # six supervisor ticks after the pause, longer than --worker-timeout
        assert tasks.swap_in(None, [1], [2]).blocks == 1
    assert pids(daemon.instance) == before and states(daemon.instance) == ["READY", "READY"]
    assert "killing rank worker" not in daemon.log()


def test_clients_that_pipeline_and_never_read_stall_only_themselves(daemons: DaemonFactory) -> None:
    """Why 1 and 3: three clients that pipeline swap requests and never read a reply: each stalls only itself
    (its requests stop being read once its replies pile up); another client is served; no worker is taken
    for hung or replaced. Their swaps name a block out of range, so that each is answered (INVALID, nothing
    moved) by a longer reply than a swap's result: the replies pile up after fewer requests."""
    daemon = daemons.start(ranks=1, args=["--worker-timeout", "1"])
    status = daemon.wait_ready()
    path = task_socket_path(daemons.run_dir, daemon.instance, 0)
    frame = request(Op.SWAP_OUT, 2, np.array([99, 1], "<i4").tobytes())
    hogs = []
    for _ in range(3):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(path))
        hello(sock, status["generation"])
        sock.settimeout(1)
        hogs.append(sock)

    def pipeline(sock: socket.socket) -> None:
        with contextlib.suppress(TimeoutError, BlockingIOError):
            for _ in range(200_000):
                sock.sendall(frame)

    fillers = [threading.Thread(target=pipeline, args=(sock,)) for sock in hogs]  # the three stall side by side
    for filler in fillers:
        filler.start()
    for filler in fillers:
        filler.join(60)
    with rc.CacheTasks(daemon.instance, timeout=10) as tasks:
        started = time.monotonic()
        assert tasks.swap_out(0, [2], [2]).blocks == 1
        assert time.monotonic() - started < 5
        time.sleep(1.5)  # longer than --worker-timeout
        assert tasks.swap_in(0, [2], [3]).blocks == 1
    assert read_status(daemon.instance)["ranks"][0]["swap"]["tasks_refused"] > 3 * 10_000  # the hogs' requests ran
    assert pids(daemon.instance) == [status["ranks"][0]["pid"]]
    for sock in hogs:
        sock.close()


def test_a_fifo_in_an_objects_place_is_a_miss(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Why 1 and 4: a FIFO where a store object should be (opening it would block forever): the load is a
    miss at once, the FIFO is removed, the next store writes the object again, and the rank is untouched."""
    store = tmp_path / "store"
    daemon = daemons.start(ranks=1, args=[*geometry(), "--storage-backend", "file", "--storage-path", str(store)])
    status = daemon.wait_ready()
    key = keys(1)
    with rc.CacheTasks(daemon.instance, timeout=20) as tasks:
        tasks.store(0, [1], key)
        (obj,) = (store / "r0").glob("*/*.kvb")
        obj.unlink()
        os.mkfifo(obj)
        started = time.monotonic()
        assert tasks.load(0, key, [2]).blocks == 0
        assert time.monotonic() - started < 5 and not obj.exists()
        assert tasks.store(0, [1], key).bytes > 0 and obj.is_file()
        assert tasks.load(0, key, [2]).blocks == 1
    assert pids(daemon.instance) == [status["ranks"][0]["pid"]]
    assert read_status(daemon.instance)["ranks"][0]["store"]["corrupt"] >= 1


# -- why 2: a runner trusted a control block owned by anyone ---------------------------------------------


def test_an_impostor_control_block_is_refused_before_a_byte_is_mapped(daemons: DaemonFactory) -> None:
    """Why 2: another uid creates the control block (mode 0644) under the instance's name before the daemon
    starts: a runner's initialize_kv_cache and CacheTasks refuse it with NotTrusted naming the owner; the
    real daemon refuses to start on a name someone else holds."""
    needs_root("acts as another user")
    instance = unique_instance()
    daemons.instances.add(instance)
    shm = posix_ipc.SharedMemory(control_name(instance), posix_ipc.O_CREX, mode=0o644, size=8192)
    try:
        os.fchown(shm.fd, 64011, 64011)
        shm.close_fd()
        with pytest.raises(rc.NotTrusted, match="belongs to uid 64011"):
            rc.initialize_kv_cache(spec(), 0, instance=instance, timeout=1)
        with pytest.raises(rc.NotTrusted, match="belongs to uid 64011"):
            rc.CacheTasks(instance)
        daemon = daemons.start(instance, ranks=1)
        assert daemon.exit_code() == 5 and "is not ours" in daemon.log()
        env = dict(os.environ, KVCACHED_DAEMON_USER="64011")
        trusting = runner_result(run_runner(env, spec=spec().to_dict(), rank=0, instance=instance, timeout=1))
        assert trusting["error_type"] in ("CacheNotReady", "ProtocolError"), trusting  # trusted, but not a daemon
    finally:
        posix_ipc.unlink_shared_memory(control_name(instance))


# -- why 3: the task channel had no flow control --------------------------------------------------------


def test_ten_thousand_pipelined_tasks_all_complete(daemons: DaemonFactory) -> None:
    """Why 3: submit(swap_out, ...) 10,000 times, then result() on each: all complete;
    the client reads replies as it goes instead of deadlocking with the worker."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    with rc.CacheTasks(daemon.instance) as tasks:
        handles = [tasks.submit(tasks.swap_out, 0, [i % 8], [i % 4]) for i in range(10_000)]
        assert sum(h.result().blocks for h in handles) == 10_000
    assert read_status(daemon.instance)["ranks"][0]["swap"]["swap_out_tasks"] == 10_000


def test_a_send_to_a_frozen_worker_times_out(daemons: DaemonFactory) -> None:
    """Why 3: a client's send to a frozen worker (SIGSTOP) gives up at its timeout with TaskTimeout instead
    of blocking forever."""
    daemon = daemons.start(ranks=1, args=[*geometry(num_blocks=8), "--worker-timeout", "60"])
    status = daemon.wait_ready()
    with rc.CacheTasks(daemon.instance, timeout=2) as tasks:
        tasks.swap_out(0, [1], [1])
        halt(status["ranks"][0]["pid"])
        try:
            started = time.monotonic()
            with pytest.raises(rc.TaskTimeout):
                for _ in range(50):  # 4 MiB of ids each: the socket's buffers fill, then the send waits
                    tasks.submit(tasks.swap_out, 0, [1] * 262_144, [1] * 262_144)
            assert time.monotonic() - started < 20
        finally:
            os.kill(status["ranks"][0]["pid"], signal.SIGCONT)


def _at_file_limit(daemons: DaemonFactory, files: int) -> tuple[Daemon, dict[str, Any], str]:
    """A one-rank daemon started under an open-file limit of ``files``: it, its status, rank 0's socket."""

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))

    daemon = daemons.start(ranks=1, popen={"preexec_fn": low_limit})
    status = daemon.wait_ready()
    return daemon, status, str(task_socket_path(daemons.run_dir, daemon.instance, 0))


def test_two_thousand_idle_connections_at_nofile_1024_leave_the_daemon_serving(daemons: DaemonFactory) -> None:
    """Why 3: under an open-file limit of 1024, 2,000 idle connections do not crash the worker
    (it used to die of EMFILE): the idle ones are closed to make room, a new client is served, the worker
    is the same."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2200:
        pytest.skip(f"this process may open at most {hard} files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 4096), hard))
    daemon, status, path = _at_file_limit(daemons, 1024)
    idle = []
    try:
        for _ in range(2000):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(path)
            idle.append(sock)
        time.sleep(1.5)  # the idle ones become evictable
        with rc.CacheTasks(daemon.instance, timeout=10) as tasks:
            assert tasks.swap_out(0, [1], [1]).blocks == 1
    finally:
        for sock in idle:
            sock.close()
    assert pids(daemon.instance) == [status["ranks"][0]["pid"]] and read_status(daemon.instance)["alive"]


def test_a_worker_at_its_connection_cap_is_asked_again_until_the_tasks_timeout(daemons: DaemonFactory) -> None:
    """A worker holding as many connections as its open-file limit leaves it, none idle (each has a frame
    begun): a new client's task is refused room, and asks again until its timeout (it failed at once),
    then fails saying so; once the hogs close, a task is served, the worker the same."""
    daemon, status, path = _at_file_limit(daemons, 200)  # the worker takes 136 connections
    hogs = []
    try:
        for _ in range(150):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            sock.sendall(b"KVT1")  # a request begun: not idle, so never closed to make room
            hogs.append(sock)
        started = time.monotonic()
        with rc.CacheTasks(daemon.instance, timeout=1.5) as tasks, pytest.raises(rc.TaskFailed, match="no room"):
            tasks.swap_out(0, [1], [1])
        assert time.monotonic() - started >= 1.4, "refused at once, not asked again until the timeout"
        closer = threading.Timer(1.0, lambda: [sock.close() for sock in hogs])
        closer.start()
        with rc.CacheTasks(daemon.instance, timeout=20) as tasks:
            assert tasks.swap_out(0, [1], [1]).blocks == 1
        closer.join()
    finally:
        for sock in hogs:
            sock.close()
    assert pids(daemon.instance) == [status["ranks"][0]["pid"]] and read_status(daemon.instance)["alive"]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_parked_partial_frames_cannot_grow_a_worker_without_bound(daemons: DaemonFactory) -> None:
    """Why 3: eight connections each parking a 60 MiB frame minus one byte used to grow a worker by 480 MiB;
    the input budget holds the growth near 2 x MAX_PAYLOAD, and another client is served meanwhile."""
    daemon = daemons.start(ranks=1)
    status = daemon.wait_ready()
    worker = status["ranks"][0]["pid"]
    before = _rss_kib(worker)
    path = str(task_socket_path(daemons.run_dir, daemon.instance, 0))
    size = 60 << 20
    head = REQUEST.pack(REQUEST_MAGIC, Op.SWAP_OUT, 0, 9, size)
    body = b"\0" * (size - 1)

    def park() -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        sock.settimeout(2)  # a frame the worker reads takes ~0.1 s; the others stay parked
        with contextlib.suppress(OSError):
            sock.sendall(head + body)
        parked.append(sock)

    parked: list[socket.socket] = []
    threads = [threading.Thread(target=park) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    try:
        grown = _rss_kib(worker) - before
        assert grown < (2 * MAX_PAYLOAD + (64 << 20)) >> 10, f"the worker grew by {grown >> 10} MiB"
        with rc.CacheTasks(daemon.instance, timeout=10) as tasks:
            assert tasks.swap_out(0, [1], [1]).blocks == 1
    finally:
        for sock in parked:
            sock.close()


# -- why 4: file store faults ---------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs: a disk that fills up (needs root to mount)."""
    needs_root("mounts a small tmpfs as a full disk")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, check=False
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_evicts_as_a_full_capacity_does(daemons: DaemonFactory, small_disk: Path) -> None:
    """Why 4: on a disk that fills before the store's capacity (4 MiB disk, 1 GiB capacity), stores go on:
    the least recently used objects are evicted on ENOSPC, the newest are there."""
    args = [*geometry(num_blocks=64), "--storage-backend", "file", "--storage-path", str(small_disk / "s")]
    daemon = daemons.start(ranks=1, args=[*args, "--storage-capacity", "1GiB", "--head-dim", "1024"])
    daemon.wait_ready()
    many = keys(64, "full")
    with rc.CacheTasks(daemon.instance) as tasks:  # 64 blocks of 64 KiB: 4 MiB and then some
        for start in range(0, 64, 8):
            assert tasks.store(0, list(range(start, start + 8)), many[start : start + 8]).blocks == 8
        assert tasks.lookup(many[-8:]) == 8
    store = read_status(daemon.instance)["ranks"][0]["store"]
    assert store["evictions"] > 0 and store["objects"] < 64


def test_a_disk_full_of_the_stores_own_objects_says_so(daemons: DaemonFactory, small_disk: Path) -> None:
    """A disk the store's own objects fill (rank 1's, which rank 0 does not evict): rank 0's store fails
    saying so, with the disk's size and what to lower, not that other files fill the disk."""
    args = [*geometry(num_blocks=64), "--storage-backend", "file", "--storage-path", str(small_disk / "s")]
    daemon = daemons.start(ranks=2, args=[*args, "--storage-capacity", "1GiB", "--head-dim", "1024"])
    daemon.wait_ready()
    many = keys(64, "own")
    with rc.CacheTasks(daemon.instance) as tasks:
        for start in range(0, 64, 8):  # rank 1 alone: it evicts its own as the disk fills
            tasks.store(1, list(range(start, start + 8)), many[start : start + 8])
        with pytest.raises(rc.TaskFailed) as failed:
            tasks.store(0, [0], keys(1, "rank 0"))
    said = str(failed.value)
    assert "this store's own objects fill the disk" in said and "lower --storage-capacity" in said, said
    assert "other files" not in said and "4.0 MiB" in said, said


def test_a_failed_write_through_changes_no_cpu_block(daemons: DaemonFactory, small_disk: Path) -> None:
    """Why 4: swap_out(keys=...) whose store fails (a full disk with nothing to evict) fails with nothing
    changed: the CPU pool is byte for byte what it was; the failure is counted."""
    args = [*geometry(), "--storage-backend", "file", "--storage-path", str(small_disk / "s")]
    daemon = daemons.start(ranks=1, args=[*args, "--storage-capacity", "1GiB"])
    daemon.wait_ready()
    ballast = small_disk / "ballast"
    with open(ballast, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\1" * 65536)
            f.flush()
    with rc.initialize_kv_cache(spec(), 0, instance=daemon.instance) as cache, rc.CacheTasks(daemon.instance) as tasks:
        fill(cache, 3)
        digests = arena_digests(daemon.instance)
        cpu = [name for name in digests if name.endswith(".cpu")]
        with pytest.raises(rc.TaskFailed) as failed:
            tasks.swap_out(0, [1, 2], [0, 1], keys=keys(2, "wt"))
        assert "other files fill the disk" in str(failed.value), failed.value  # the ballast, not the store
        assert {n: arena_digests(daemon.instance)[n] for n in cpu} == {n: digests[n] for n in cpu}
    assert read_status(daemon.instance)["ranks"][0]["store"]["errors"] >= 1


def test_foreign_things_at_object_names_and_deleted_objects(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Why 4: an object replaced by a directory is a miss (and removed), not an error for every later load;
    an object deleted by hand is not present to lookup and is written again by the next store."""
    store = tmp_path / "store"
    daemon = daemons.start(ranks=1, args=[*geometry(), "--storage-backend", "file", "--storage-path", str(store)])
    daemon.wait_ready()
    two = keys(2, "foreign")
    with rc.CacheTasks(daemon.instance) as tasks:
        tasks.store(0, [1, 2], two)
        first, second = (next((store / "r0").glob(f"*/{k.hex()}.kvb")) for k in two)
        first.unlink()
        first.mkdir()
        (first / "junk").write_text("x")
        assert tasks.load(0, two, [3, 4]).blocks == 0 and not first.exists()
        assert tasks.load(0, two, [3, 4]).blocks == 0, "every later load is a miss, not an error"
        second.unlink()
        assert tasks.lookup(two[1:]) == 0
        assert tasks.store(0, [1, 2], two).bytes == 2 * spec().block_bytes, "both written again"
        assert tasks.load(0, two, [3, 4]).blocks == 2


def test_the_store_directory_removed_while_running(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Why 4: the store directory removed while the daemon runs is noticed within seconds, counted and
    logged, made again and locked again at once (a second daemon on the same path is refused), and stores
    work again without a restart."""
    store = tmp_path / "store"
    args = [*geometry(), "--storage-backend", "file", "--storage-path", str(store)]
    daemon = daemons.start(ranks=1, args=args)
    daemon.wait_ready()
    with rc.CacheTasks(daemon.instance) as tasks:
        tasks.store(0, [1], keys(1))
        import shutil

        shutil.rmtree(store)
        until(lambda: read_status(daemon.instance)["ranks"][0]["store"]["errors"] >= 1, what="loss noticed")
        assert (store / "r0" / ".lock").exists()
        second = daemons.start(ranks=1, args=args)
        assert second.exit_code() == 5 and "used by another kvcached daemon" in second.log()
        assert "stop the other one, or give this instance another --storage-path" in second.log()
        assert tasks.store(0, [1], keys(1)).blocks == 1 and tasks.lookup(keys(1)) == 1
    assert "store directory removed while the daemon runs" in daemon.log()


def test_a_store_lock_let_go_within_seconds_is_taken(daemons: DaemonFactory, tmp_path: Path) -> None:
    """A rank directory whose lock another process holds and lets go of two seconds later (a replaced worker's
    store agent, killed with it, still exiting: seen under load after a worker's kill -9) is waited for and
    taken: the rank starts with its store, where its start used to fail at once with the store busy."""
    store = tmp_path / "store"
    (store / "r0").mkdir(parents=True)
    for path in (store, store / "r0"):
        path.chmod(0o700)
    hold = "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
    hold += "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(2.0)"
    holder = subprocess.Popen(
        [sys.executable, "-c", hold, str(store / "r0" / ".lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        args = [*geometry(), "--storage-backend", "file", "--storage-path", str(store)]
        daemon = daemons.start(ranks=1, args=args)
        daemon.wait_ready()
        with rc.CacheTasks(daemon.instance) as tasks:
            assert tasks.store(0, [1], keys(1)).blocks == 1 and tasks.lookup(keys(1)) == 1
    finally:
        holder.kill()
        holder.wait()


def test_the_store_directory_replaced_by_another_users_is_refused_as_unavailable(
    daemons: DaemonFactory, tmp_path: Path
) -> None:
    """The rank's store directory swapped at run time for a symlink to a copy another user owns: store,
    lookup and load fail as StoreUnavailable naming the directory and the fix, as a start would refuse it;
    the daemon says so in one warning line, without a traceback; put back, the store works again."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    import shutil

    store = tmp_path / "store"
    args = [*geometry(), "--storage-backend", "file", "--storage-path", str(store)]
    daemon = daemons.start(ranks=1, args=args)
    daemon.wait_ready()
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    with rc.CacheTasks(daemon.instance) as tasks:
        tasks.store(0, [1], keys(1))
        shutil.copytree(store / "r0", theirs)
        for path in (theirs, *theirs.rglob("*")):
            os.chown(path, 64012, 64012, follow_symlinks=False)
        (store / "r0").rename(ours)
        (store / "r0").symlink_to(theirs)
        calls = {"store": lambda: tasks.store(0, [1], keys(1)), "lookup": lambda: tasks.lookup(keys(1))}
        calls["load"] = lambda: tasks.load(0, keys(1), [2])
        for name, call in calls.items():
            with pytest.raises(rc.StoreUnavailable) as refused:
                call()
            said = str(refused.value)
            assert f"{store / 'r0'} is owned by uid 64012" in said and "--storage-path" in said, (name, said)
        (store / "r0").unlink()
        ours.rename(store / "r0")
        assert tasks.store(0, [1], keys(1)).blocks == 1 and tasks.lookup(keys(1)) == 1
    log = daemon.log()
    assert log.count("store directory replaced; store tasks fail until it is fixed") == 1, log
    assert "Traceback" not in log and "task failed" not in log, log


# -- why 5 and 6: the run directory, and no traceback for an operator --------------------------------------


def test_a_symlink_at_the_lock_file_is_refused_never_followed(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Why 5: a symlink planted at <run_dir>/<instance>.lock is refused (exit 5); its target is untouched."""
    instance = unique_instance()
    daemons.instances.add(instance)
    daemons.run_dir.mkdir(parents=True, exist_ok=True)
    target = tmp_path / "precious"
    target.write_text("keep me")
    (daemons.run_dir / f"{instance}.lock").symlink_to(target)
    daemon = daemons.start(instance, ranks=1)
    assert daemon.exit_code() == 5 and "Traceback" not in daemon.log()
    assert target.read_text() == "keep me"


@pytest.mark.parametrize("kind", ["file", "open to all"])
def test_a_run_directory_that_is_a_file_or_open_to_all_is_refused(daemons: DaemonFactory, kind: str) -> None:
    """Why 5 and 6: KVCACHED_RUN_DIR pointing at a file, or at a directory anyone may write: exit 5 with
    the reason, no traceback, nothing created."""
    run_dir = daemons.tmp_path / "odd"
    if kind == "file":
        run_dir.write_text("")
    else:
        run_dir.mkdir()
        run_dir.chmod(0o777)
    daemon = daemons.start(ranks=1, env=daemons.env(KVCACHED_RUN_DIR=str(run_dir)))
    assert daemon.exit_code() == 5
    log = daemon.log()
    assert ("not a directory" if kind == "file" else "writable by anyone") in log and "Traceback" not in log
    assert shm_entries(daemon.instance) == []


def test_dev_shm_filling_up_mid_start_is_exit_5_without_a_traceback(daemons: DaemonFactory) -> None:
    """Why 6: /dev/shm filling between the semaphores and the control block (ENOSPC, injected) exits 5 (no
    restart under systemd), says so, and leaves nothing."""
    daemon = daemons.start(ranks=2, env=daemons.env(KVCACHED_FAULT="after-semaphores:enospc"))
    assert daemon.exit_code() == 5
    assert "No space left on device" in daemon.log() and "Traceback" not in daemon.log()
    assert shm_entries(daemon.instance) == []


def test_one_instance_with_two_run_directories_at_once(daemons: DaemonFactory) -> None:
    """Why 6: the same instance started twice with two run directories: the second exits 3 naming the holder,
    and the first keeps serving (its semaphores were not reclaimed by the second)."""
    first = daemons.start(ranks=2)
    status = first.wait_ready()
    second = daemons.start(first.instance, ranks=2, env=daemons.env(KVCACHED_RUN_DIR=str(daemons.tmp_path / "other")))
    assert second.exit_code() == 3 and f"pid {first.pid}" in second.log()
    result = runner_result(run_runner(daemons.env(), spec=spec().to_dict(), rank=1, instance=first.instance))
    assert result["ok"] and result["generation"] == status["generation"]


def test_status_of_a_tampered_control_block_is_a_message_not_a_traceback(daemons: DaemonFactory) -> None:
    """Why 6: `kvcached status` on a control block whose bytes were overwritten: a clean error, exit 1."""
    instance = unique_instance()
    daemons.instances.add(instance)
    shm = posix_ipc.SharedMemory(control_name(instance), posix_ipc.O_CREX, mode=0o600, size=8192)
    os.write(shm.fd, b"NOTOURS!" + b"\xff" * 100)
    shm.close_fd()
    try:
        done = daemons.cli("status", "--instance", instance)
        assert done.returncode == 1 and "not a kvcached control block" in done.stderr
        assert "Traceback" not in done.stderr
    finally:
        posix_ipc.unlink_shared_memory(control_name(instance))


def cli_as(uid: int, *args: str) -> str:
    """Run the kvcached CLI in a child that dropped to ``uid`` (no exec: the interpreter may live where other
    users cannot read it): "exit N: <output>", or the traceback an operator would have seen. Imported
    here, before the fork: the child's uid may not read the interpreter's own modules."""
    from click.testing import CliRunner

    import kvcached.doctor
    import kvcached.fastdeploy.checkup  # noqa: F401 - the commands' own imports, before the fork too
    from kvcached.cli import main

    def action() -> str:
        result = CliRunner().invoke(main, list(args))
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            return "Traceback: " + repr(result.exception)
        return f"exit {result.exit_code}: {result.output}"

    return as_user(uid, uid, [], action)


def test_status_and_stop_by_an_outsider_say_so(daemons: DaemonFactory) -> None:
    """Why 6 and 7: `status` and `stop` run by a user outside the daemon's group: a clear error and a non-zero
    exit, no traceback; `stop` no longer says "not running" while the daemon runs."""
    needs_root("acts as another user")
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    for command in ("status", "stop"):
        said = cli_as(64012, command, "--instance", daemon.instance)
        assert said.startswith("exit 1: ") and "permission denied" in said, said
    assert read_status(daemon.instance)["alive"]


# -- why 7: the smaller ones ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["stop", "status"])
def test_an_empty_instance_name_is_a_usage_error(daemons: DaemonFactory, command: str) -> None:
    """Why 7: `--instance ''` no longer silently means `default`."""
    done = daemons.cli(command, "--instance", "")
    assert done.returncode == 2 and "Invalid value for --instance: must be 1-48 characters" in done.stderr


def test_a_relative_run_dir_is_published_absolute(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Why 7: a relative KVCACHED_RUN_DIR is made absolute before it is published, so a runner elsewhere
    finds the task sockets."""
    work = tmp_path / "cwd"
    work.mkdir()
    daemon = daemons.start(ranks=1, env=daemons.env(KVCACHED_RUN_DIR="rel-run"), popen={"cwd": work})
    daemon.wait_ready()
    with rc.CacheTasks(daemon.instance) as tasks:
        assert tasks.swap_out(0, [1], [1]).blocks == 1
    assert (work / "rel-run").is_dir()


def test_sigusr1_is_logged_not_fatal(daemons: DaemonFactory) -> None:
    """Why 7: SIGUSR1 used to kill the supervisor and leave 48 MiB in /dev/shm: now it logs the ranks."""
    daemon = daemons.start(ranks=2)
    daemon.wait_ready()
    os.kill(daemon.pid, signal.SIGUSR1)
    until(lambda: '"signal": "SIGUSR1"' in daemon.log(), what="the ranks logged")
    assert read_status(daemon.instance)["alive"]


@contextlib.contextmanager
def sigusr1_flood(pid: int) -> Iterator[None]:
    """Another process sending ``pid`` SIGUSR1 without pause while the block runs."""
    code = f"import os, signal\ntry:\n    while True: os.kill({pid}, signal.SIGUSR1)\nexcept ProcessLookupError: pass"
    flood = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield
    finally:
        flood.kill()
        flood.wait()


def test_a_flood_of_sigusr1_neither_stalls_the_supervisor_nor_loses_a_stop(daemons: DaemonFactory) -> None:
    """A hostile pass: while another process sends SIGUSR1 without pause, a killed worker is replaced (the supervisor
    had taken the pipe until it was empty, which a flood never lets it be, and stayed out of its loop), and a SIGTERM
    stops the daemon (its number had been dropped by the full pipe: the daemon served on)."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    with sigusr1_flood(daemon.pid):
        time.sleep(1)
        worker = pids(daemon.instance)[0]
        os.kill(worker, signal.SIGKILL)
        until(
            lambda: states(daemon.instance) == ["READY"] and pids(daemon.instance)[0] != worker,
            timeout=8,
            what="the killed worker replaced during the flood",
        )
        time.sleep(1)  # the pipe full again
        os.kill(daemon.pid, signal.SIGTERM)
        assert daemon.proc.wait(30) == 0, "the stop sent during the flood was honoured"


def test_a_restart_during_a_flood_of_sigusr1_restarts(daemons: DaemonFactory) -> None:
    """A hostile pass: a SIGUSR1 reaching a restarting daemon between its exec and the next image's handlers ended it
    (the signal's default action); it is held pending until then, as the stop and restart signals are. A flood logs
    the ranks about once a second, not once a turn of the loop."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    before = read_status(daemon.instance)["generation"]
    with sigusr1_flood(daemon.pid):
        started = time.monotonic()
        done = daemons.cli("restart", "--instance", daemon.instance)
        time.sleep(1)
        flooded = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    status = read_status(daemon.instance)
    assert status["alive"] and status["pid"] == daemon.pid and status["generation"] != before
    assert daemon.log().count('"signal": "SIGUSR1"') <= flooded + 3


def test_a_closed_log_pipe_does_not_kill_the_daemon(daemons: DaemonFactory) -> None:
    """Why 7: `kvcached start | tee` with tee gone: the next log line used to kill the daemon; now lines are
    dropped and it serves on (a worker killed and replaced logs warnings meanwhile)."""
    read_end, write_end = os.pipe()
    daemon = daemons.start(ranks=2, popen={"stdout": write_end, "stderr": write_end})
    os.close(write_end)
    daemon.wait_ready()
    os.close(read_end)  # the reader is gone
    status = read_status(daemon.instance)
    os.kill(status["ranks"][0]["pid"], signal.SIGKILL)
    until(
        lambda: states(daemon.instance) == ["READY", "READY"] and pids(daemon.instance)[0] != status["ranks"][0]["pid"]
    )
    with rc.CacheTasks(daemon.instance) as tasks:
        assert tasks.swap_out(None, [1], [1]).blocks == 1
    assert daemon.proc.poll() is None


def test_a_record_left_odd_does_not_make_a_runner_spin(daemons: DaemonFactory) -> None:
    """Why 7: a record whose seqlock was left odd (its writer died mid-write) while the daemon lives: the
    waiting runner pauses between looks instead of spinning at 100 % CPU, and times out with CacheNotReady."""
    instance = unique_instance()
    daemons.instances.add(instance)
    block = ControlBlock.create(instance, generation=7, spec=spec(), num_ranks=1, daemon_pid=os.getpid(),
                                daemon_start=_own_start())  # fmt: skip
    try:
        block._buf[4096] = 1  # seq of rank 0 odd
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        proc = run_runner(daemons.env(), spec=spec().to_dict(), rank=0, instance=instance, timeout=3)
        result = runner_result(proc)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        assert result["error_type"] == "CacheNotReady", result
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        assert cpu < 1.5, f"the runner spun: {cpu:.1f} s of CPU in a 3 s wait"
    finally:
        block.unlink()
        block.close()


def _own_start() -> int:
    from kvcached.protocol.proc import self_identity

    return self_identity()[1]


def test_timeout_zero_attaches_a_ready_rank(daemons: DaemonFactory) -> None:
    """Why 7: initialize_kv_cache(..., timeout=0) looks before it checks the deadline: a READY rank attaches."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    with rc.initialize_kv_cache(spec(), 0, instance=daemon.instance, timeout=0) as cache:
        assert cache.owner == "daemon"


def test_cache_tasks_after_close_is_a_clear_error(daemons: DaemonFactory) -> None:
    """Why 7: using a CacheTasks after close() raises InvalidTask saying so, not a raw OSError."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    tasks = rc.CacheTasks(daemon.instance)
    tasks.swap_out(0, [1], [1])
    tasks.close()
    with pytest.raises(rc.InvalidTask, match="is closed"):
        tasks.swap_out(0, [1], [1])


# -- why 8: hermetic tests --------------------------------------------------------------------------------


def test_two_mooncake_masters_at_once(tmp_path: Path) -> None:
    """Why 8: every master the tests start takes its own ports (metrics too), so two suites on one host do
    not collide."""
    pytest.importorskip("mooncake.store", reason="the mooncake extra is not installed")
    masters = [MooncakeMaster(tmp_path / f"m{i}.log") for i in range(2)]
    try:
        for master in masters:
            master.launch()  # both at once: each takes a second to listen
        for master in masters:
            master.start()
        assert all(m.proc is not None and m.proc.poll() is None for m in masters)
    finally:
        for master in masters:
            master.stop()


def test_tasks_lost_together_are_told_at_once_and_within_their_timeout(daemons: DaemonFactory) -> None:
    """Twenty tasks in flight on one connection whose worker is killed while the supervisor is stopped (the
    rank reads READY under the dead worker, nobody there to mark it): each raises TaskLost; the rank's record
    is looked at once per connection, for at most the first task's timeout (each task waited a second: 20 s
    in all), and the others take that verdict at once."""
    daemon = daemons.start(ranks=1)
    worker = daemon.wait_ready()["ranks"][0]["pid"]
    with rc.CacheTasks(daemon.instance, timeout=30) as tasks:
        assert tasks.swap_out(0, [1], [1]).blocks == 1  # the connection is open
        with frozen(daemon.pid):
            halt(worker)
            handles = [tasks.submit(tasks.swap_out, 0, [1], [1]) for _ in range(20)]
            os.kill(worker, signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(rc.TaskLost):
                handles[0].result(timeout=0.3)
            first = time.monotonic() - started
            for handle in handles[1:]:
                with pytest.raises(rc.TaskLost, match="the worker closed the connection"):
                    handle.result(timeout=30)
            took = time.monotonic() - started
    assert first < 5 and took < 10, (first, took)  # generous: they took 20 s
