"""`kvcached restart` against what an operator or a neighbour does meanwhile: a stop sent while the next image
is checked, the metrics port taken, a configuration file whose geometry changed, a garbled handover."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

import runner_client as rc
from kvcached.daemon import lockfile
from kvcached.daemon.requests import KEEP_SIGNAL
from kvcached.protocol.names import instance_lock_path
from kvcached.status import read_status
from tests.conftest import ROOT, DaemonFactory, MooncakeMaster, free_port, shm_entries, unique_instance
from tests.test_mooncake_hosts import FLAGS, alive, keeper_pid, restart_daemon, start_host, store_prefix, until


def restart_cli(daemons: DaemonFactory, instance: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvcached.cli", "restart", "--instance", instance, "--timeout", "30"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=daemons.env(),
        cwd=ROOT,
    )


def wait_for_preflight(pid: int, *, gone: bool = False) -> None:
    """Until daemon ``pid`` runs its next image's check (`start --check-config`, a child of it); with
    ``gone``, until it runs none."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        running = False
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            with contextlib.suppress(OSError):
                running |= b"--check-config" in Path(f"/proc/{child}/cmdline").read_bytes()
        if running != gone:
            return
        time.sleep(0.002)
    raise AssertionError(f"the restart's check of the next image {'never ended' if gone else 'never ran'}")


@pytest.mark.parametrize("keep", [True, False])
def test_a_stop_sent_while_the_restart_is_checked_is_honoured(daemons: DaemonFactory, keep: bool) -> None:
    """The signal of `stop` (or `stop --keep`) sent while the restarting daemon checks its next image (sent
    by the test itself, so that it lands while the check runs, which a CLI starting up on a loaded machine
    may miss) is not dropped: the daemon ends as the stop asks, keeping the memory for the next start with
    --keep, releasing it without; `restart` says which, not that the daemon exited unexplained."""
    daemon = daemons.start()
    daemon.wait_ready()
    restarting = restart_cli(daemons, daemon.instance)
    wait_for_preflight(daemon.pid)
    os.kill(daemon.pid, KEEP_SIGNAL if keep else signal.SIGTERM)
    said, _ = restarting.communicate(timeout=40)
    assert daemon.exit_code(20) == 0, daemon.log()
    assert "a stop came while the restart was checked" in daemon.log()
    assert restarting.returncode == 1 and "instead of restarting" in said, said
    assert ("memory is kept for the next" in said) == keep and ("the cache is gone" in said) != keep, said
    if keep:
        assert {rank["state"] for rank in read_status(daemon.instance)["ranks"]} == {"KEPT"}
        again = daemons.start(daemon.instance)
        assert again.wait_ready()["note"].startswith("adopted"), again.log()
        again.stop()
    else:
        assert shm_entries(daemon.instance) == []


def test_a_restart_sent_after_another_was_accepted_says_it_was_refused(daemons: DaemonFactory) -> None:
    """Two `kvcached restart` at once, the second sent after the daemon accepted the first: the image the
    first started refuses the second (its ranks are not READY yet); the first reports the restart, exit 0,
    the second that its own was refused, exit 1, though the generation changed meanwhile."""
    env = daemons.env(KVCACHED_FAULT="restart-accepted:sleep=2.5")
    daemon = daemons.start(env=env)
    before = daemon.wait_ready()["generation"]
    first = restart_cli(daemons, daemon.instance)
    wait_for_preflight(daemon.pid)
    wait_for_preflight(daemon.pid, gone=True)  # the check passed: the restart is accepted at once
    time.sleep(0.3)
    second = restart_cli(daemons, daemon.instance)
    said_first, _ = first.communicate(timeout=60)
    said_second, _ = second.communicate(timeout=60)
    assert first.returncode == 0 and "restarted" in said_first, said_first + daemon.log()
    assert second.returncode == 1, said_second + daemon.log()
    assert "restart refused, the daemon serves on" in said_second, said_second
    assert "an earlier restart was under way" in said_second, said_second
    after = read_status(daemon.instance)
    assert after["generation"] != before and all(r["state"] == "READY" for r in after["ranks"]), after
    assert daemon.proc.poll() is None
    daemon.kill9()  # what the daemon recorded of the restarts is a leftover like its sockets
    assert daemons.cli("doctor", "--clean", "--instance", daemon.instance).returncode in (0, 1)
    assert not list(daemons.run_dir.glob(f"{daemon.instance}.*")), "a file of the killed daemon was left"


def test_a_restart_whose_metrics_port_was_taken_meanwhile_serves_on(daemons: DaemonFactory) -> None:
    """Someone takes the metrics port while the restart executes the next image: the restart completes, the
    memory adopted, the daemon warns and serves without metrics, then listens again once the port is free."""
    port = free_port()
    env = daemons.env(KVCACHED_FAULT="before-exec:sleep=1.5")
    daemon = daemons.start(args=["--metrics-port", str(port)], env=env)
    daemon.wait_ready()
    restarting = restart_cli(daemons, daemon.instance)
    squatter = socket.socket()
    deadline = time.monotonic() + 20
    while True:  # the old image lets go of the port before its exec
        try:
            squatter.bind(("127.0.0.1", port))
            break
        except OSError:
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.01)
    squatter.listen()
    try:
        out, _ = restarting.communicate(timeout=40)
        assert restarting.returncode == 0 and "adopted" in out, out + daemon.log()
        assert daemon.proc.poll() is None
        assert "serving without metrics" in daemon.log()
    finally:
        squatter.close()
    deadline = time.monotonic() + 20
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
                assert b"kvcached_rank_state" in response.read()
            break
        except OSError:
            assert time.monotonic() < deadline, daemon.log()
            time.sleep(0.2)


def test_a_keeper_of_a_store_no_longer_configured_is_let_go(daemons: DaemonFactory, mooncake: MooncakeMaster) -> None:
    """A daemon that stored on Mooncake is killed -9 (its keeper lives on, as it should for the next run) and
    the instance is started again without a store: that start lets the keeper go, says so, and leaves no
    socket of it behind."""
    host = start_host(daemons, mooncake)
    store_prefix(host, 4, salt=7)
    keeper = keeper_pid(host)
    host.daemon.kill9()
    host.args = list(FLAGS)
    restart_daemon(daemons, host)
    until(lambda: not alive(keeper), timeout=30, what="the keeper of the store no longer configured ends")
    assert not list(host.run_dir().glob(f"{host.instance}.mooncake.*")), "a keeper's file (socket, lock, log) was left"
    assert "let go of what another storage backend kept" in host.daemon.log()


@pytest.mark.parametrize(
    ("changed", "said"),
    [
        ({"num_blocks": 16}, "num_blocks was 8, this configuration has 16"),
        ({"num_cpu_blocks": 2}, "num_cpu_blocks was 4"),
    ],
)
def test_a_restart_whose_configuration_changed_the_geometry_is_refused_up_front(
    daemons: DaemonFactory, tmp_path: Path, changed: dict[str, int], said: str
) -> None:
    """The configuration file edited to another geometry, then `kvcached restart`: refused before anything
    stops, naming the field, its old and new values and what to do; the daemon serves on, the same
    generation."""
    config = tmp_path / "kv.toml"
    values = {"num_layers": 2, "kv_heads": 2, "head_dim": 16, "block_size": 4, "num_blocks": 8, "num_cpu_blocks": 4}
    config.write_text("".join(f"{key} = {value}\n" for key, value in values.items()))
    daemon = daemons.start(ranks=2, small=False, args=["--config", str(config)])
    before = daemon.wait_ready()
    config.write_text("".join(f"{key} = {value}\n" for key, value in {**values, **changed}.items()))
    done = daemons.cli("restart", "--instance", daemon.instance, "--timeout", "30")
    assert done.returncode == 1 and "restart refused, the daemon serves on" in done.stderr, done.stdout + done.stderr
    assert said in done.stderr and "stop the daemon without --keep" in done.stderr, done.stderr
    assert "could not adopt the cache" in done.stderr and "cannot start" not in done.stderr, done.stderr
    after = read_status(daemon.instance)
    assert after["generation"] == before["generation"] and all(r["state"] == "READY" for r in after["ranks"])
    assert daemon.proc.poll() is None


@pytest.mark.parametrize(
    "value", ["[" * 100_000, '{"workers": ' * 5_000, "x" * 100_000, '{"generation": "zz"}', '{"0": [1, 4]}']
)
def test_a_garbled_handover_value_is_refused_and_the_start_goes_on(daemons: DaemonFactory, value: str) -> None:
    """KVCACHED_HANDOVER that no image writes (nested deeper than Python's stack, too long, garbage, the form
    without a generation that an earlier release wrote) is ignored, said in the log, and the daemon starts as
    any start does."""
    daemon = daemons.start(ranks=1, env=daemons.env(KVCACHED_HANDOVER=value))
    daemon.wait_ready()
    assert "ignoring KVCACHED_HANDOVER: not what an earlier image writes" in daemon.log()
    assert "Traceback" not in daemon.log()


def test_the_names_locks_stay_held_across_a_restart(daemons: DaemonFactory) -> None:
    """Across `kvcached restart` the instance's lock files stay where they are, the same files, held all the
    while (handed to the next image across its exec): another user waiting for the name to come free (it
    was free some 300 ms in each restart) never finds it so, and the restarted daemon holds the name."""
    daemon = daemons.start()
    daemon.wait_ready()
    locks = [instance_lock_path(daemon.instance), daemons.run_dir / f"{daemon.instance}.lock"]
    inodes = [path.stat().st_ino for path in locks]
    seen: list[str] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            for path, inode in zip(locks, inodes, strict=True):
                try:
                    if path.stat().st_ino != inode:
                        seen.append(f"{path} replaced")
                except FileNotFoundError:
                    seen.append(f"{path} absent")
                if lockfile.flock_holder(path) != daemon.pid:
                    seen.append(f"{path} not held by the daemon")
            time.sleep(0.001)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        restarted = daemons.cli("restart", "--instance", daemon.instance, "--timeout", "30")
    finally:
        done.set()
        watcher.join()
    assert restarted.returncode == 0 and "adopted from" in restarted.stdout, restarted.stdout + restarted.stderr
    assert not seen, sorted(set(seen))
    assert "KVCACHED_HELD_LOCKS" not in daemon.log(), "the handover's variable warned of as unknown"
    assert daemon.stop() == 0 and not any(path.exists() for path in locks)


@pytest.mark.parametrize("fd", ["2", "3", "4", "1000", "99999999999999999999", "\u00b2"])
def test_a_garbled_held_locks_variable_changes_nothing_of_a_start(daemons: DaemonFactory, fd: str) -> None:
    """``KVCACHED_HELD_LOCKS`` naming descriptors no image left (stderr, the start's own epoll or pipes, one
    not open, a number past any, not a number) at a plain start: nothing of it is closed or taken (the
    start crashed, or lost its log into the lock file); the daemon serves and stops cleanly."""
    instance = unique_instance()
    lock = instance_lock_path(instance)
    env = daemons.env(KVCACHED_HELD_LOCKS=f"{fd} {lock}\n{fd} {daemons.run_dir / f'{instance}.lock'}\n")
    daemon = daemons.start(instance, ranks=1, env=env, executed=True)
    daemon.wait_ready()
    with rc.CacheTasks(instance) as tasks:
        assert tasks.swap_out(0, [1], [1]).blocks == 1
    said = daemon.log()
    assert '"event": "all ranks ready"' in said and "Traceback" not in said, said  # its log still goes to stderr
    assert daemon.stop() == 0
    assert not lock.exists()
