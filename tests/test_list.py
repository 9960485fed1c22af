"""``kvcached list``: the host's instances, each as it truly is, as root and as another user; and whom a
shell trusts without being told (the owner of /run/kvcached)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from kvcached.protocol.trust import service_uid
from kvcached.status import is_ready, read_status
from tests.conftest import ROOT, DaemonFactory, shm_entries, unique_instance

NOBODY = 65534
AS_NOBODY = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups", "--"]


def held(instance: str) -> int:
    """Bytes the instance's objects occupy in /dev/shm, counted here."""
    return sum(os.lstat(f"/dev/shm/{name}").st_blocks * 512 for name in shm_entries(instance))


def wait_ready(instance: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not is_ready(read_status(instance, any_owner=True)):
        assert proc.poll() is None and time.monotonic() < deadline, f"not READY (exit {proc.poll()})"
        time.sleep(0.02)


def listed(daemons: DaemonFactory, prefix: list[str] | None = None) -> dict[str, dict[str, Any]]:
    done = daemons.cli("list", "--json", prefix=prefix)
    assert done.returncode == 0, done.stderr
    return {item["instance"]: item for item in json.loads(done.stdout)}


def test_list_shows_two_users_instances_one_killed_each_as_it_is(daemons: DaemonFactory) -> None:
    """Root's instance, running, and nobody's, killed -9: root's list shows both with their owner, state,
    ranks, memory and whether the daemon runs; nobody's list shows its own only (root's is not readable to
    it); the table says the same in words."""
    if os.geteuid() != 0:
        pytest.skip("needs root to start a daemon as another user")
    base = Path(tempfile.mkdtemp(prefix="kvt-list-"))  # the test's tmp_path is private to root
    try:
        os.chmod(base, 0o777)
        mine = daemons.start(ranks=2)
        instance = unique_instance()
        daemons.instances.add(instance)
        theirs = subprocess.Popen(  # setpriv: the interpreter may lie where nobody cannot look, and still runs
            [*AS_NOBODY, sys.executable, "-m", "kvcached.cli", "start", "--instance", instance, "--ranks", "1"],
            env=daemons.env(KVCACHED_RUN_DIR=str(base / "run")),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=ROOT,
        )
        mine.wait_ready()
        wait_ready(instance, theirs)
        theirs.kill()
        theirs.wait()
        seen = listed(daemons)
        a, b = seen[mine.instance], seen[instance]
        assert (a["owner_uid"], a["owner"], a["state"], a["ranks"]) == (0, "root", "READY", 2), a
        assert (a["daemon_running"], a["pid"], a["memory_bytes"]) == (True, mine.pid, held(mine.instance)), a
        assert (b["owner_uid"], b["owner"], b["state"], b["states"]) == (NOBODY, "nobody", "DEAD", {"READY": 1}), b
        assert (b["daemon_running"], b["pid"], b["ranks"]) == (False, None, 1), b
        assert b["memory_bytes"] == held(instance) > 0, b
        table = daemons.cli("list").stdout
        row = next(line for line in table.splitlines() if line.startswith(instance + " ")).split()
        assert row[1:6] == ["DEAD,", "was", "1", "READY", "1"] and row[6:8] == ["65534", "(nobody)"], row
        assert row[-2:] == ["not", "running"], row
        row = next(line for line in table.splitlines() if line.startswith(mine.instance + " ")).split()
        assert row[1:5] == ["READY", "2", "0", "(root)"] and row[-3:] == ["running", "(pid", f"{mine.pid})"], row
        theirs_only = listed(daemons, prefix=AS_NOBODY)
        assert instance in theirs_only and mine.instance not in theirs_only
        assert theirs_only[instance] == b
        status = daemons.cli("status", "--instance", instance)  # root reads it, naming its owner
        assert status.returncode == 1 and "owner uid 65534 (nobody)" in status.stdout, status.stdout + status.stderr
        assert "impostor" not in status.stdout + status.stderr
    finally:
        daemons.teardown()
        shutil.rmtree(base, ignore_errors=True)


def test_the_service_user_is_the_owner_of_a_run_directory_only_root_can_make(tmp_path: Path) -> None:
    """/run/kvcached's owner is trusted when only root can have given it to them: a directory of root's that
    nobody else may write holds it, and nobody but its owner may write it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    run = tmp_path / "run"
    run.mkdir(mode=0o755)
    service = run / "kvcached"
    service.mkdir(mode=0o750)
    os.chown(service, NOBODY, NOBODY)
    assert service_uid(service) == NOBODY
    service.chmod(0o770)  # its group could put another in its place
    assert service_uid(service) is None
    service.chmod(0o750)
    run.chmod(0o777)  # anyone could have made it
    assert service_uid(service) is None
    run.chmod(0o755)
    service.rename(run / "real")
    service.symlink_to(run / "real")
    assert service_uid(service) is None
    assert service_uid(run / "absent") is None
