"""What a neighbour (another uid on the host) can plant, and what kvcached does about it: a lock file naming
someone else's process, an object squatting the instance lock's name, group members of an instance."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcached.protocol.proc import start_time
from tests.conftest import DaemonFactory, unique_instance
from tests.test_faults import needs_root

NEIGHBOUR = 64012  # a uid with no account: owning files is all it needs


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """A process of this user that no kvcached command may signal."""
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


def plant_lock(directory: Path, instance: str, pid: int, owner: int) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = directory / f"{instance}.lock"
    lock.write_text(f"{pid} {start_time(pid)}\n")
    os.chown(directory, owner, owner)
    os.chown(lock, owner, owner)


@pytest.mark.parametrize("command", ["stop", "restart"])
def test_stop_and_restart_signal_no_pid_a_neighbours_lock_file_names(
    daemons: DaemonFactory, tmp_path: Path, victim: subprocess.Popen[bytes], command: str
) -> None:
    """A neighbour owning the run directory (as it may own /tmp/kvcached-0 before root's first start) writes a
    lock file naming a process of root: `stop` and `restart` refuse, naming why, and signal nothing."""
    needs_root("the neighbour is another uid")
    instance = unique_instance()
    directory = tmp_path / "neighbours"
    plant_lock(directory, instance, victim.pid, NEIGHBOUR)
    env = daemons.env(KVCACHED_RUN_DIR=str(directory))
    done = daemons.cli(command, "--instance", instance, "--timeout", "3", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "refusing to signal" in done.stderr and f"uid {NEIGHBOUR}" in done.stderr, done.stderr
    time.sleep(0.2)
    assert victim.poll() is None


def test_stop_signals_no_process_of_its_own_user_that_is_not_a_daemon(
    daemons: DaemonFactory, tmp_path: Path, victim: subprocess.Popen[bytes]
) -> None:
    """A lock file of the right owner that names a process which is no kvcached daemon (and holds no lock):
    refused, the reason named."""
    instance = unique_instance()
    directory = tmp_path / "mine"
    plant_lock(directory, instance, victim.pid, os.geteuid())
    env = daemons.env(KVCACHED_RUN_DIR=str(directory))
    done = daemons.cli("stop", "--instance", instance, "--timeout", "3", env=env)
    assert done.returncode == 1 and "is not a kvcached daemon" in done.stderr, done.stdout + done.stderr
    assert victim.poll() is None


def test_stop_still_stops_the_daemon_whose_lock_it_reads(daemons: DaemonFactory) -> None:
    """The checks let the real daemon through: its lock file, its uid, its flock."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    done = daemons.cli("stop", "--instance", daemon.instance)
    assert done.returncode == 0, done.stderr
    assert daemon.exit_code(10) == 0
