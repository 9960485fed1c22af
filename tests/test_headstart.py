"""``tests/helpers/headstart.py`` does what docs/contributing.md says of it, in a pytest session of its own.

In one test process the jobs the selected tests take begin as the first test starts, before the first test
that takes one, in a background thread, their commands at the lowest CPU priority; a job still running when
the session ends has its processes ended and its directory removed, and a session that runs no test begins
none. With several test processes (pytest-xdist) nothing begins early: the test that takes a job does its
work then, in its own thread. In both, work begun early is reported, ended and cleaned up as work done
inline would be: a failed job's traceback, the environment its commands see, a killed test process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT
from tests.helpers import headstart

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


def test_a_session_that_runs_no_test_begins_no_job(tmp_path: Path) -> None:
    """``--fixtures`` runs no test (as ``--collect-only`` and ``--setup-plan``): no job begins for it."""
    done = run_probe(tmp_path, "one", "-n", "0", "--fixtures")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (tmp_path / "probe-dir").exists() and not (tmp_path / "sleeper-dir").exists()


@headstart.job("where")
def where(directory: Path) -> Path:
    return directory


@pytest.mark.head_start("where")
def test_a_job_runs_in_a_directory_of_its_own_under_the_sessions_base(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Under pytest's base temporary directory, which pytest's rotation removes when a killed session left it."""
    directory: Path = headstart.take("where")
    assert directory.is_dir() and directory.parent == tmp_path_factory.getbasetemp(), directory
    assert headstart.take("where") is directory, "a job runs once per test process"


@headstart.job("planted-failure")
def planted_failure(directory: Path) -> None:
    raise AssertionError("planted: the scratch copy failed")


@pytest.mark.head_start("no-such-job")
def test_a_mark_naming_no_job_fails_only_the_test_that_takes_it() -> None:
    """In a one-process run too: the session goes on (no INTERNALERROR), the take says what is wrong."""
    with pytest.raises(LookupError, match="no head-start job named 'no-such-job'"):
        headstart.take("no-such-job")


def test_each_take_of_a_failed_job_reports_the_jobs_own_failure() -> None:
    """The second test to take a failed job sees the job's traceback, not the first test's frames."""

    def first_taker() -> None:
        headstart.take("planted-failure")

    def second_taker() -> None:
        headstart.take("planted-failure")

    with pytest.raises(AssertionError, match="planted"):
        first_taker()
    with pytest.raises(AssertionError, match="planted") as second:
        second_taker()
    frames = [frame.name for frame in traceback.extract_tb(second.value.__traceback__)]
    assert "second_taker" in frames and "planted_failure" in frames, frames
    assert "first_taker" not in frames, frames
    assert any("head-start job 'planted-failure'" in note for note in second.value.__notes__)


def test_a_command_sees_the_environment_the_session_started_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a test running meanwhile sets (``run_dir``'s KVCACHED_RUN_DIR, ...) does not reach a job's command."""
    monkeypatch.setenv("KVCACHED_TEST_SET_MEANWHILE", "by the test running now")
    result = headstart.run(["env"])
    assert result.returncode == 0, result.stderr
    assert "KVCACHED_TEST_SET_MEANWHILE=" not in result.stdout
    assert f"PATH={os.environ['PATH']}" in result.stdout.splitlines()


#: Begins job "command", whose work is ``sys.argv[2]`` seconds of Python, then ``bash -c sys.argv[1]``; ends
#: the session (``finish``) after ``sys.argv[3]`` seconds, or never when it is negative.
DRIVER = """
import sys, time
from pathlib import Path
from tests.helpers import headstart

@headstart.job("command")
def command(directory):
    time.sleep(float(sys.argv[2]))
    return headstart.run(["bash", "-c", sys.argv[1]])

headstart.begin(["command"], Path(sys.argv[4]))
print("begun", flush=True)
if float(sys.argv[3]) < 0:
    time.sleep(600)
time.sleep(float(sys.argv[3]))
headstart.finish()
print("finished", flush=True)
"""


def driver(command: str, python_s: float, finish_after: float, base: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", DRIVER, command, str(python_s), str(finish_after), str(base)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def processes(argument: str) -> list[int]:
    """Live processes whose command line holds ``argument``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and argument in (entry / "cmdline").read_bytes().decode().split("\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def until(check: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_the_sessions_end_starts_no_command_a_job_asks_for_after_it(tmp_path: Path) -> None:
    """The session ends while a job is still in its Python part: its command is refused, not run to its end
    (a minute of pip under ``-x`` or Ctrl-C)."""
    token = f"600.{os.getpid()}1"
    proc = driver(f"sleep {token}", 1.0, 0.1, tmp_path)
    try:
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and out.split() == ["begun", "finished"], out
        assert not processes(token), "the command started after the session ended"
    finally:
        proc.kill()
        for pid in processes(token):
            os.kill(pid, signal.SIGKILL)


def test_the_sessions_end_interrupts_a_running_command_as_ctrl_c_would(tmp_path: Path) -> None:
    """A command running when the session ends gets SIGINT first (pip removes its temporary directories),
    then SIGKILL."""
    said = tmp_path / "interrupted"
    token = f"600.{os.getpid()}2"
    proc = driver(f"trap 'echo yes > {said}; exit 130' INT; sleep {token}", 0.0, 2.0, tmp_path)
    try:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and out.split() == ["begun", "finished"], out
        assert said.read_text() == "yes\n", "the command was not interrupted"
        assert not processes(token)
    finally:
        proc.kill()
        for pid in processes(token):
            os.kill(pid, signal.SIGKILL)


def test_a_killed_test_process_leaves_no_process_of_a_job(tmp_path: Path) -> None:
    """kill -9 of the test process: the job's whole process group ends, not only the command it started."""
    token = f"600.{os.getpid()}3"
    proc = driver(f"sleep {token}; true", 0.0, -1, tmp_path)  # bash, and below it the sleep
    try:
        assert until(lambda: processes(token), 30), "the job's command did not start"
        proc.kill()
        proc.wait()
        assert until(lambda: not processes(token), 30), "the job's command outlived the test process"
    finally:
        proc.kill()
        for pid in processes(token):
            os.kill(pid, signal.SIGKILL)


class _Item:
    """What ``headstart.last`` and ``wanted`` read of a test item: its head_start marks."""

    def __init__(self, *jobs: str) -> None:
        self.marks = [pytest.mark.head_start(job).mark for job in jobs]

    def iter_markers(self, name: str) -> list[Any]:
        return [mark for mark in self.marks if mark.name == name]


def test_the_tests_that_take_a_job_run_last_and_a_heavy_job_begins_after_the_others() -> None:
    headstart.job("order-light")(lambda directory: None)
    headstart.job("order-heavy", heavy=True)(lambda directory: None)
    plain, heavy, light, other = _Item(), _Item("order-heavy"), _Item("order-light"), _Item()
    items: list[Any] = [plain, heavy, light, other]
    assert headstart.last(items) == [plain, other, heavy, light]
    assert headstart.wanted(items) == ["order-light", "order-heavy"]
