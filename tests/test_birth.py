"""The tests fork their daemons from a zygote (``tests/helpers/zygote.py``) where the birth cannot differ
from an executed daemon's: held to that here, from outside, as a neighbour or an operator sees a daemon."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvcached.daemon.lockfile import is_kvcached_daemon
from tests.conftest import ROOT, Daemon, DaemonFactory, zygote
from tests.helpers.zygote import EXEC_ENV, ZygoteChild
from tests.test_faults import needs_root


@pytest.fixture(autouse=True)
def _forking(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests compare the two births: the zygote forks here even under ``KVCACHED_TEST_EXEC=1``."""
    monkeypatch.delenv(EXEC_ENV, raising=False)


STATUS_FIELDS = ("SigBlk", "SigIgn", "SigCgt", "Umask", "NoNewPrivs", "Seccomp", "Uid", "Gid", "Groups")
#: glibc's own signals (32 and 33, below SIGRTMIN): a process catches them from its first thread on, and a
#: worker makes its first (the pool's prefault) just after its rank is READY.
GLIBC_SIGNALS = (1 << 31) | (1 << 32)


def looks(pid: int, instance: str, log: str) -> dict[str, Any]:
    """What the kernel shows of process ``pid`` and its children, its own names written as placeholders."""

    def plain(target: str) -> str:
        named = target.replace(instance, "INSTANCE").replace(log, "LOG")
        return re.sub(r"\[\d+\]", "[]", re.sub(r"\.[0-9a-f]{16}\.", ".GENERATION.", named))

    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    status["SigCgt"] = f"{int(status['SigCgt'], 16) & ~GLIBC_SIGNALS:016x}"
    fds = sorted(plain(os.readlink(f"/proc/{pid}/fd/{fd}")) for fd in os.listdir(f"/proc/{pid}/fd"))
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return {
        "status": {field: status[field].strip() for field in STATUS_FIELDS},
        "fds": fds,
        "cwd": os.readlink(f"/proc/{pid}/cwd"),
        "daemon": is_kvcached_daemon(pid),
        "children": sorted((looks(int(child), instance, log) for child in children), key=repr),
    }


def settled(daemon: Daemon, ranks: int) -> dict[str, Any]:
    """``looks`` of ``daemon`` once it has ``ranks`` workers and no other child: right after a restart a
    worker of the last image may still be ending (its descriptors still open, its command line gone), or
    be gone between the listing of the children and the look at it."""
    deadline = time.monotonic() + 10
    while True:
        try:
            seen = looks(daemon.pid, daemon.instance, str(daemon.log_path))
        except (FileNotFoundError, KeyError):  # a child gone, or a zombie (its status has no Umask)
            if time.monotonic() > deadline:
                raise
            continue
        whole = len(seen["children"]) == ranks and all(child["daemon"] for child in seen["children"])
        if whole or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)


def alike(one: Daemon, other: Daemon, ranks: int) -> dict[str, Any]:
    """``settled`` of the two daemons, asserted the same within 10 s: a worker opens what it keeps (its pool's
    prefault thread, for one) just after its rank is READY, so one look may catch a worker still opening."""
    deadline = time.monotonic() + 10
    while True:
        seen = [settled(daemon, ranks) for daemon in (one, other)]
        if seen[0] == seen[1] or time.monotonic() > deadline:
            assert seen[0] == seen[1]
            return seen[0]
        time.sleep(0.1)


def test_a_forked_daemon_looks_as_an_executed_one_and_restarts_and_stops_as_one(daemons: DaemonFactory) -> None:
    forked = daemons.start(ranks=2)
    executed = daemons.start(ranks=2, executed=True)
    assert isinstance(forked.proc, ZygoteChild), "the zygote did not fork this start"
    assert isinstance(executed.proc, subprocess.Popen)
    forked.wait_ready()
    executed.wait_ready()
    seen = alike(forked, executed, 2)
    assert seen["daemon"] and len(seen["children"]) == 2
    for daemon in (forked, executed):
        done = daemons.cli("restart", "--instance", daemon.instance)
        assert done.returncode == 0, done.stdout + done.stderr
    alike(forked, executed, 2)
    assert forked.stop() == 0 == executed.stop()


def test_a_forked_runner_has_imported_nothing_of_kvcached_an_executed_one_has_not(tmp_path: Path) -> None:
    """The runner zygote imports ``runner_client`` only: a runner it forks holds no module of kvcached,
    click or structlog that an executed runner would not (a runner must never lean on the daemon's code)."""
    script = tmp_path / "modules.py"
    script.write_text(
        "import json, sys\nimport runner_client, runner_client.wait\nprint(json.dumps(sorted(sys.modules)))\n"
    )
    env = dict(os.environ)
    births = zygote("runner")
    assert births.forks(env, None)
    forked, err = births.popen({"path": str(script)}, [], env).communicate(60)
    executed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, check=True)
    extra = set(json.loads(forked)) - set(json.loads(executed.stdout))
    ours = ("kvcached", "runner_client", "click", "structlog", "numpy", "posix_ipc")
    assert not [name for name in extra if name.split(".")[0] in ours], (extra, err)


REUSED_PID = """
import os, sys
from pathlib import Path
from tests.helpers.zygote import Zygote
births, env = Zygote("runner"), dict(os.environ)
script = [sys.argv[1]]
first = births.popen({"path": script[0]}, ["3", "0"], env)
assert first.wait(30) == 3
Path("/proc/sys/kernel/ns_last_pid").write_text(str(first.pid - 1))  # the pid space wraps here and now
second = births.popen({"path": script[0]}, ["0", "1"], env)
print(second.pid == first.pid, second.poll(), second.wait(30))
births.close()
"""


def test_a_child_given_an_earlier_childs_pid_reads_its_own_exit(tmp_path: Path) -> None:
    """The zygote reaps at once, so the kernel gives a child's pid again (after 32768 here, minutes on a busy
    host): a later child with that pid is running until it exits, with its own code. In a pid namespace of
    its own, whose next pid this test sets."""
    needs_root("sets the next pid of a pid namespace")
    script = tmp_path / "exit_with.py"
    script.write_text("import sys, time\ntime.sleep(float(sys.argv[2]))\nsys.exit(int(sys.argv[1]))\n")
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", REUSED_PID, str(script)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    if done.returncode != 0 and "unshare" in done.stderr:
        pytest.skip(f"no pid namespace here: {done.stderr.strip()}")
    assert done.stdout.split() == ["True", "None", "0"], done.stdout + done.stderr
