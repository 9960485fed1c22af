"""What a neighbour (another uid on the host) can plant, and what kvcached does about it: a lock file naming
someone else's process, an object squatting the instance lock's name, group members of an instance."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcached.protocol.names import instance_lock_path
from kvcached.protocol.proc import start_time
from tests.conftest import DaemonFactory, unique_instance
from tests.test_faults import needs_root, until

NEIGHBOUR = 64012  # a uid with no account: owning files is all it needs
#: An interpreter any uid may run (the test's own may sit in a directory only root reaches).
PYTHON = shutil.which("python3", path="/usr/bin:/usr/local/bin:/bin") or "python3"


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


def test_stop_believes_no_lock_file_whose_process_does_not_hold_the_instance_lock(
    daemons: DaemonFactory,
) -> None:
    """A neighbour made the run directory root's command reads first (as /tmp/kvcached-0 may be) and runs a
    process named `kvcached start` of its own there, holding the lock file it wrote: the real daemon (another
    run directory) holds the host-wide lock in /dev/shm, so `stop` believes the lock file not, and stops the
    daemon the instance's control block names."""
    needs_root("the neighbour is another uid")
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    theirs = Path(tempfile.mkdtemp(prefix="kvt-neighbour-", dir="/tmp"))  # where that uid can reach it
    os.chown(theirs, NEIGHBOUR, NEIGHBOUR)
    lock = theirs / f"{daemon.instance}.lock"
    holds = (
        "import fcntl, os, sys, time; fd = os.open(sys.argv[2], os.O_RDWR | os.O_CREAT, 0o600); "
        "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'%d %s\\n' % (os.getpid(), open(f'/proc/{os.getpid()}/stat')"
        ".read().rsplit(')', 1)[1].split()[19].encode())); time.sleep(600)"
    )
    fake = subprocess.Popen(
        ["setpriv", f"--reuid={NEIGHBOUR}", f"--regid={NEIGHBOUR}", "--clear-groups", "bash", "-c",
         f'exec -a kvcached {PYTHON} -c "$0" start "$1"', holds, str(lock)]
    )  # fmt: skip
    try:
        until(lambda: lock.exists() and lock.stat().st_size > 0, timeout=10, what="the neighbour's lock file")
        env = daemons.env(KVCACHED_RUN_DIR=str(theirs))
        done = daemons.cli("stop", "--instance", daemon.instance, "--timeout", "3", env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert daemon.exit_code(10) == 0, "the daemon the control block names was stopped"
        assert fake.poll() is None, "the neighbour's process was signalled"
    finally:
        fake.kill()
        fake.wait()
        shutil.rmtree(theirs, ignore_errors=True)


def doctor_leftovers(daemons: DaemonFactory, instance: str, *args: str) -> tuple[subprocess.CompletedProcess[str], Any]:
    """`kvcached doctor --json` for ``instance``: the run, and its ``leftovers`` check."""
    done = daemons.cli("doctor", "--json", "--instance", instance, *args)
    assert "Traceback" not in done.stderr, done.stderr
    (check,) = [c for c in json.loads(done.stdout)["checks"] if c["name"] == "leftovers"]
    return done, check


def test_a_file_squatting_the_instance_lock_is_named_by_start_and_doctor(daemons: DaemonFactory) -> None:
    """Another uid's file at the instance lock's name in /dev/shm: `start` exits 5 saying whose file holds the
    name, that it is no kvcached lock, and how to remove it; `doctor` fails the leftovers check naming it;
    `doctor --clean` leaves it (not ours to remove) and says what to do, without a traceback."""
    needs_root("the squatter is another uid")
    instance = unique_instance()
    daemons.instances.add(instance)
    squat = instance_lock_path(instance)
    squat.touch()
    os.chown(squat, NEIGHBOUR, NEIGHBOUR)
    try:
        daemon = daemons.start(instance, ranks=1)
        assert daemon.exit_code(30) == 5
        said = daemon.log()
        assert f"uid {NEIGHBOUR}" in said and "not a kvcached lock" in said and f"rm {squat}" in said, said
        for args in ((), ("--clean",)):
            done, check = doctor_leftovers(daemons, instance, *args)
            assert done.returncode == 1 and check["verdict"] == "fail", check
            assert str(squat) in check["advice"], check
            assert squat.exists() and squat.stat().st_uid == NEIGHBOUR
    finally:
        squat.unlink()


def test_doctor_clean_removes_what_a_dead_instances_mooncake_keeper_left(daemons: DaemonFactory) -> None:
    """A dead instance's keeper socket and lock file in its run directory (the keeper gone too) are removed by
    `doctor --clean`, and counted."""
    instance = unique_instance()
    daemons.instances.add(instance)
    daemons.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    sock_path = daemons.run_dir / f"{instance}.mooncake.sock"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(sock_path))  # closed unlistened: a dead keeper's socket file
    lock = daemons.run_dir / f"{instance}.mooncake.lock"
    lock.touch(mode=0o600)
    log = daemons.run_dir / f"{instance}.mooncake.log"
    log.write_text("the keeper's log\n")
    _, check = doctor_leftovers(daemons, instance, "--clean")
    assert not sock_path.exists() and not lock.exists() and not log.exists(), check
    files = sorted([lock.name, log.name, sock_path.name])
    assert check["verdict"] == "ok" and sorted(check["measured"]["store_files"]) == files


def test_a_start_by_another_user_of_a_running_name_says_it_runs_and_whose_it_is(daemons: DaemonFactory) -> None:
    """Another user's `kvcached start` of a name a daemon runs under: exit 3 (already running), naming the
    daemon's pid and uid; not exit 5 with advice to remove the lock file in /dev/shm, which is the running
    daemon's, not a squatter's. The start runs in a fork dropped to the neighbour's uid (the interpreter
    may live where that uid cannot read it)."""
    needs_root("the neighbour is another uid")
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    home = Path(tempfile.mkdtemp(prefix="kvcached-neighbour-"))
    try:
        os.chown(home, NEIGHBOUR, NEIGHBOUR)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 99
            try:
                from kvcached import cli, running  # noqa: F401 (imported while the interpreter's files can be read)
                from kvcached.daemon import supervisor  # noqa: F401

                os.setgroups([])
                os.setgid(NEIGHBOUR)
                os.setuid(NEIGHBOUR)
                os.environ.update(KVCACHED_RUN_DIR=str(home / "run"), XDG_CACHE_HOME=str(home / "cache"))
                log = os.open(home / "log", os.O_WRONLY | os.O_CREAT, 0o600)
                os.dup2(log, 1)
                os.dup2(log, 2)
                sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__  # not pytest's capture
                cli.main(["start", "--instance", daemon.instance, "--ranks", "1"])
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 98
            except BaseException as exc:
                os.write(2, f"{exc!r}".encode())  # the child's own failure, for the assertion's message
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        said = (home / "log").read_text()
    finally:
        shutil.rmtree(home)
    assert os.waitstatus_to_exitcode(status) == 3, said
    assert f"(pid {daemon.pid}, a daemon of uid {os.geteuid()}," in said and "rm " not in said, said
    assert daemon.proc.poll() is None
