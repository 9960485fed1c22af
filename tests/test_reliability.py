"""The reliability suite: crash the daemon on purpose, race it, squat its names, fuzz its inputs.

Everything is real: daemon processes, SIGKILL, /dev/shm, sockets. The slow tests are marked ``slow`` and
still run in ``.ci/run``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import signal
import socket
import time
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import posix_ipc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import runner_client as rc
from kvcached.config import DaemonConfig, defaults
from kvcached.daemon import faults
from kvcached.protocol.errors import InvalidConfig, KVCacheError
from kvcached.protocol.messages import REQUEST, REQUEST_MAGIC, Op
from kvcached.protocol.names import SHM_DIR, control_name, task_socket_path
from kvcached.status import read_status
from tests.conftest import Daemon, DaemonFactory, run_runner, runner_result, shm_entries, unique_instance

SMALL = rc.CacheSpec(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4)
SUPERVISOR_STEPS = ("after-lock", "after-reclaim", "after-semaphores", "before-publish", "after-control-block")
WORKER_STEPS = ("worker-allocating", "worker-before-ready")
#: Steps of a restart's handover: killed at in tests/test_kill_steps.py.
HANDOVER_STEPS = ("worker-prepared", "after-relieve", "restart-accepted", "before-exec")


# -- 2. kill -9 at each start-up step -------------------------------------------------------------------


@pytest.mark.parametrize("step", SUPERVISOR_STEPS + WORKER_STEPS)
def test_kill9_at_each_startup_step(daemons: DaemonFactory, step: str) -> None:
    """A runner waiting from before the start never sees READY from the killed run: it fails, or it is
    served by the next start, which succeeds; nothing is left in /dev/shm (the fixture checks after the
    clean stop)."""
    named = SUPERVISOR_STEPS + WORKER_STEPS + HANDOVER_STEPS + ("after-ready", *faults.WORK_STEPS)
    assert set(named) == set(faults.STEPS)
    instance = unique_instance()
    daemons.instances.add(instance)
    env = daemons.env()
    waiter = run_runner(env, spec=SMALL.to_dict(), rank=1, instance=instance, timeout=30)
    killed = daemons.start(instance, ranks=2, env=daemons.env(KVCACHED_FAULT=f"{step}:kill"))
    code = killed.exit_code(timeout=30)
    if step in SUPERVISOR_STEPS:
        assert code == -signal.SIGKILL
    else:
        assert code == 1, "workers killed at start-up (each replacement too) fail the rank: the supervisor exits 1"
    survivor = daemons.start(instance, ranks=2)
    status = survivor.wait_ready()
    result = runner_result(waiter)
    if result["ok"]:
        assert result["generation"] == status["generation"], f"a runner attached to a run killed at {step}: {result}"
    else:
        assert result["error_type"] in ("DaemonGone", "RankFailed"), result
    attached = runner_result(run_runner(env, spec=SMALL.to_dict(), rank=1, instance=instance, timeout=10))
    assert attached["ok"] and attached["generation"] == status["generation"], attached
    assert survivor.stop() == 0
    assert shm_entries(instance) == []


# -- 3. leak loop ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_leak_loop_start_kill9_restart(daemons: DaemonFactory) -> None:
    """50 rounds of start, kill -9, restart; then a clean stop: /dev/shm and the run directory are back
    to what they were."""
    instance = unique_instance()
    daemons.instances.add(instance)
    daemons.run_dir.mkdir(parents=True, exist_ok=True)
    run_files = set(os.listdir(daemons.run_dir))
    for _ in range(50):
        daemon = daemons.start(instance, ranks=2)
        daemon.wait_ready()
        daemon.kill9()
    last = daemons.start(instance, ranks=2)
    last.wait_ready()
    assert len(shm_entries(instance)) == 10, "each restart adopted the memory and reclaimed every other object"
    assert last.stop() == 0
    assert shm_entries(instance) == [], "objects left in /dev/shm"
    assert set(os.listdir(daemons.run_dir)) == run_files, "files left in the run directory"


# -- 4. double start ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_double_start_races(daemons: DaemonFactory) -> None:
    """20 races of two daemons with one name: exactly one wins, the loser exits 3, and the winner's
    objects (control block inode, generation, arenas) are untouched."""
    for _ in range(20):
        instance = unique_instance()
        a = daemons.start(instance, ranks=1)
        b = daemons.start(instance, ranks=1)
        loser, winner = wait_one_exits(a, b)
        assert loser.exit_code() == 3, loser.log()
        assert "already running" in loser.log()
        status = winner.wait_ready()
        inode = os.stat(SHM_DIR / control_name(instance).lstrip("/")).st_ino
        entries = shm_entries(instance)
        time.sleep(0.05)
        assert read_status(instance)["generation"] == status["generation"]
        assert os.stat(SHM_DIR / control_name(instance).lstrip("/")).st_ino == inode
        assert shm_entries(instance) == entries
        assert winner.stop() == 0


def wait_one_exits(a: Daemon, b: Daemon, timeout: float = 30) -> tuple[Daemon, Daemon]:
    """(the one that exited, the one still running) of two racing daemons."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [d for d in (a, b) if d.proc.poll() is not None]
        if done:  # the other one must then come up READY and stop cleanly (the caller checks both)
            assert len(done) == 1, f"both exited:\n{a.log()}\n{b.log()}"
            return (a, b) if done[0] is a else (b, a)
        time.sleep(0.01)
    raise AssertionError("neither daemon exited: two winners")


def test_two_instances_never_cross(daemons: DaemonFactory) -> None:
    first, second = daemons.start(ranks=2), daemons.start(ranks=2)
    s1, s2 = first.wait_ready(), second.wait_ready()
    assert s1["generation"] != s2["generation"]
    assert not set(shm_entries(first.instance)) & set(shm_entries(second.instance))
    with rc.CacheTasks(first.instance) as tasks:
        tasks.swap_out(None, [1], [1])
    assert read_status(second.instance)["ranks"][0]["swap"]["swap_out_tasks"] == 0
    before = shm_entries(second.instance)
    assert first.stop() == 0
    assert shm_entries(first.instance) == []
    assert shm_entries(second.instance) == before and read_status(second.instance)["alive"]


# -- 5. squatting and permissions -----------------------------------------------------------------------


@pytest.mark.parametrize("squat", ["other-owner", "other-mode"])
def test_squatted_names_are_refused_never_used_or_deleted(daemons: DaemonFactory, instance: str, squat: str) -> None:
    if squat == "other-owner" and os.geteuid() != 0:
        pytest.skip("needs root to create an object owned by another user")
    path = SHM_DIR / control_name(instance).lstrip("/")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, b"not a kvcached control block")
        if squat == "other-owner":
            os.fchown(fd, 64002, 64002)
        else:
            os.fchmod(fd, 0o644)
        daemon = daemons.start(instance, ranks=1)
        assert daemon.exit_code(timeout=30) == 5
        assert "refusing to use or delete it" in daemon.log() and str(path) in daemon.log()
        assert path.read_bytes() == b"not a kvcached control block", "the squatter's object was changed"
        assert shm_entries(instance) == [path.name], "the refused start left objects"
    finally:
        os.close(fd)
        path.unlink()


# -- 7. fuzzing -----------------------------------------------------------------------------------------


def arena_digest(instance: str) -> str:
    digest = hashlib.sha256()
    for name in sorted(shm_entries(instance)):
        if name.endswith((".dev", ".cpu")):
            digest.update((SHM_DIR / name).read_bytes())
    return digest.hexdigest()


frames = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda op, flags, task_id, declared, payload, cut: (
            REQUEST.pack(REQUEST_MAGIC, op, flags, task_id, declared) + payload
        )[: cut or None],
        st.integers(0, 65535),
        st.integers(0, 65535),
        st.integers(0, 2**64 - 1),
        st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1)),
        st.binary(max_size=96),
        st.integers(0, 120),
    ),
    st.builds(
        lambda ids: REQUEST.pack(REQUEST_MAGIC, Op.SWAP_OUT, 0, 1, 4 * len(ids)) + np.array(ids, "<i4").tobytes(),
        st.lists(st.integers(-(2**31), 2**31 - 1), max_size=16),
    ),
)


@pytest.mark.slow
def test_fuzzed_task_frames_never_crash_hang_or_change_a_block(daemons: DaemonFactory) -> None:
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    instance = daemon.instance
    rng = np.random.default_rng(5)
    with rc.initialize_kv_cache(SMALL, 0, instance=instance, timeout=10) as cache:
        for tensor in cache.key_caches + cache.value_caches:
            tensor.view(np.uint8)[...] = rng.integers(0, 256, tensor.nbytes, dtype=np.uint8).reshape(
                tensor.view(np.uint8).shape
            )
    before = arena_digest(instance)
    path = str(task_socket_path(daemons.run_dir, instance, 0))

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(frames)
    def send(frame: bytes) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(path)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(frame)
                sock.shutdown(socket.SHUT_WR)
            with contextlib.suppress(ConnectionResetError):
                while sock.recv(65536):  # a reply or a close, never a hang (the timeout would raise)
                    pass

    send()
    assert daemon.proc.poll() is None, daemon.log()
    assert arena_digest(instance) == before, "a fuzzed frame changed a block"
    with rc.CacheTasks(instance) as tasks:  # still serving
        assert tasks.swap_out(0, [1], [1]).blocks == 1
    status = read_status(instance)
    assert status["ranks"][0]["state"] == "READY" and status["ranks"][0]["swap"]["tasks_refused"] > 0


@pytest.mark.slow
def test_random_control_block_bytes_give_clear_errors(instance: str) -> None:
    """A control block full of random bytes (published magic or not): status, the waiting runner and the
    task client raise kvcached errors or report not running/not alive; nothing hangs or crashes."""
    name = control_name(instance)

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.binary(min_size=0, max_size=9000), st.booleans())
    def check(raw: bytes, magic: bool) -> None:
        content = (b"KVCACHED" + raw[8:]) if magic else raw
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=max(len(content), 1))
        try:
            os.pwrite(shm.fd, content, 0)
            shm.close_fd()
            with contextlib.suppress(KVCacheError):
                status = read_status(instance)
                assert status["alive"] is False or status["ranks"] == [] or isinstance(status["ranks"], list)
            started = time.monotonic()
            with pytest.raises(KVCacheError):
                rc.initialize_kv_cache(SMALL, 0, instance=instance, timeout=0.02)
            with pytest.raises(KVCacheError):
                rc.CacheTasks(instance, timeout=1).swap_out(0, [0], [0])
            assert time.monotonic() - started < 10
        finally:
            posix_ipc.unlink_shared_memory(name)

    check()


#: What an error about a config file may name: a known key, a spec field, the file itself.
NAMEABLE = {*defaults(), *(f.name for f in dataclasses.fields(rc.CacheSpec)), "config"}
toml_values = st.one_of(
    st.integers(-(2**40), 2**40),
    st.text(max_size=12),
    st.booleans(),
    st.floats(allow_nan=False),
    st.lists(st.integers(), max_size=3),
)


@pytest.mark.slow
def test_random_config_files_give_errors_naming_the_field(tmp_path: Path) -> None:
    keys = st.one_of(st.sampled_from(sorted(defaults())), st.from_regex(r"[a-z_]{1,12}", fullmatch=True))

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(keys, toml_values, max_size=6), st.binary(max_size=60))
    def check(values: dict[str, Any], junk: bytes) -> None:
        path = tmp_path / "config.toml"
        path.write_text("".join(f"{k} = {toml(v)}\n" for k, v in values.items()))
        try:
            tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError:
            return
        try:
            DaemonConfig.build({}, path, environ={})
        except InvalidConfig as exc:
            assert exc.field in NAMEABLE or exc.field in values, (exc.field, str(exc))
            assert str(path) in exc.source, f"the error does not name the file: {exc}"
        path.write_bytes(junk)
        with contextlib.suppress(InvalidConfig):
            DaemonConfig.build({}, path, environ={})

    check()


def toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').encode("unicode_escape").decode() + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml(v) for v in value) + "]"
    return repr(value)


def test_bad_config_file_through_the_cli_creates_nothing(daemons: DaemonFactory, instance: str) -> None:
    config = daemons.tmp_path / "bad.toml"
    config.write_text('ranks = "eight"\n')
    result = daemons.cli("start", "--instance", instance, "--config", str(config))
    assert result.returncode == 4 and f"{config}: ranks: must be a TOML integer" in result.stderr, result.stderr
    assert shm_entries(instance) == []


# -- 8. a rank worker killed under an attached runner ---------------------------------------------------


def test_worker_kill9_costs_at_most_the_task_in_flight(daemons: DaemonFactory) -> None:
    """kill -9 of a rank worker while a runner keeps swapping: at most the task in flight fails (TaskLost,
    naming its target blocks); tasks succeed again within 2 s; the daemon stays up and says why it replaced
    the worker."""
    daemon = daemons.start(ranks=2)
    status = daemon.wait_ready()
    lost = []
    with rc.CacheTasks(daemon.instance) as tasks:
        tasks.swap_out(1, [0], [0])
        killed = time.monotonic()
        os.kill(status["ranks"][1]["pid"], signal.SIGKILL)
        while True:
            try:
                tasks.swap_out(1, [0], [0], timeout=2)
                break
            except rc.TaskLost as exc:
                assert exc.rank == 1 and exc.blocks == (0,), exc
                lost.append(exc)
        assert time.monotonic() - killed < 2.0
        assert len(lost) <= 1
    after = read_status(daemon.instance)
    assert after["alive"] and [r["state"] for r in after["ranks"]] == ["READY", "READY"]
    assert after["ranks"][1]["pid"] != status["ranks"][1]["pid"]
    assert "killed by SIGKILL" in daemon.log() and "replacing rank worker on the same memory" in daemon.log()
