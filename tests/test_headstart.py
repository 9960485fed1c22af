"""``tests/helpers/headstart.py`` does what README says of it, in a pytest session of its own.

In one test process the jobs the selected tests take begin once the tests are collected, before the first
test that takes one, in a background thread, their commands at the lowest CPU priority; a job still running
when the session ends has its processes killed and its directory removed. With several test processes
(pytest-xdist) nothing begins early: the test that takes a job does its work then, in its own thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PROBE = """
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import headstart

OUT = Path(os.environ["HEADSTART_PROBE_OUT"])
ONE_PROCESS = os.environ["HEADSTART_PROBE_MODE"] == "one"


@headstart.job("probe")
def probe(directory):
    (OUT / "probe-dir").write_text(str(directory))
    niceness = headstart.run([sys.executable, "-c", "import os; print(os.nice(0))"])
    (OUT / "probe-began").write_text("")
    return threading.current_thread().name, niceness.stdout.strip()


@headstart.job("sleeper")
def sleeper(directory):
    (OUT / "sleeper-dir").write_text(str(directory))
    headstart.run(["sh", "-c", f"echo $$ > {OUT}/sleeper-pid; exec sleep 300"])


def test_before_any_test_takes_it():
    if ONE_PROCESS:  # begun at the session's start: it goes on while this test waits
        deadline = time.monotonic() + 60
        while not (OUT / "probe-began").exists():
            assert time.monotonic() < deadline, "the probe job was not begun before its test's turn"
            time.sleep(0.05)
    else:
        assert not (OUT / "probe-began").exists(), "a job began early under pytest-xdist"


@pytest.mark.head_start("probe")
def test_takes_the_probe():
    thread, niceness = headstart.take("probe")
    assert niceness == "19"
    if ONE_PROCESS:
        assert thread.startswith("head-start"), thread
    else:
        assert thread == "MainThread", thread


@pytest.mark.head_start("sleeper")
def test_leaves_the_sleeper_running():
    if not ONE_PROCESS:
        pytest.skip("nothing begins early under pytest-xdist")
    deadline = time.monotonic() + 60
    while not (OUT / "sleeper-pid").exists():
        assert time.monotonic() < deadline, "the sleeper job was not begun"
        time.sleep(0.05)
"""


def run_probe(tmp_path: Path, mode: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The probe tests in a pytest session of their own, the project's conftest loaded as a plugin."""
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    head_start(name): see tests/helpers/headstart.py\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    env.update(PYTHONPATH=str(ROOT), HEADSTART_PROBE_OUT=str(tmp_path), HEADSTART_PROBE_MODE=mode)
    argv = [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-c"]
    argv += [str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), "-q", "-rs", *args, "test_probe.py"]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)


def test_one_process_begins_the_jobs_early_and_ends_them_with_the_session(tmp_path: Path) -> None:
    done = run_probe(tmp_path, "one", "-n", "0")
    assert done.returncode == 0 and "3 passed" in done.stdout, done.stdout + done.stderr
    pid = int((tmp_path / "sleeper-pid").read_text())
    with pytest.raises(ProcessLookupError):  # killed at the session's end (and reaped), not left to sleep
        os.kill(pid, 0)
    for job in ("probe", "sleeper"):
        assert not Path((tmp_path / f"{job}-dir").read_text()).exists(), f"{job}'s directory was left"


def test_several_processes_begin_nothing_early(tmp_path: Path) -> None:
    done = run_probe(tmp_path, "xdist", "-n", "1")
    assert done.returncode == 0 and "2 passed, 1 skipped" in done.stdout, done.stdout + done.stderr
    assert not (tmp_path / "sleeper-dir").exists(), "a job no test took was run"
