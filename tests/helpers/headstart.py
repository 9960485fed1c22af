"""The slow work of a few tests, begun as soon as the session's first test starts, so a one-process run waits less.

Four jobs spend their time waiting on tools: pip building and installing the project (README's quickstart,
systemd/README.md's install steps, the wheel) and the benchmarks' smoke run; the tests marked
``@pytest.mark.head_start(name)`` take them. In a one-process session (``-n 0``, or no ``-n``) the other
tests leave the second core mostly idle, so that work runs there, in one background thread, a heavy job
(the benchmarks) after the others, while the other tests run: the tests that take a job run last
(``last``, from conftest), when it is done. A test takes the result and asserts on it exactly
what it asserted on work it did itself: the same commands, the same checks; only the moment they run
differs. With several test processes (pytest-xdist) nothing is begun early: ``take`` does the work when it
is asked. ``tests/test_headstart.py`` checks both.

Invariants: a job runs at most once per test process, in a directory of its own under the session's base
temporary directory; its result, or the exception it raised, is what every ``take`` of it returns or raises
(with the job's own traceback each time, not the takes before). Its commands (``run``) see the environment
the test process started with, never what a test running meanwhile has set, and each runs in a process
group that ends with the test process however that ends (``tests/helpers/jobgroup.py``: SIGINT, then
SIGKILL). Once the session ends no command starts, running ones are ended that way, and every job's
directory is removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

#: name -> the work: called with an empty directory of its own, returns what ``take`` hands the test.
_JOBS: dict[str, Callable[[Path], Any]] = {}
_HEAVY: set[str] = set()
_futures: dict[str, Future[Any]] = {}
#: name -> the exception its work raised and where (``take`` raises it from there each time).
_raised: dict[str, tuple[BaseException, TracebackType | None]] = {}
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_running: set[subprocess.Popen[str]] = set()
_directories: list[Path] = []
_base: Path | None = None
_closing = threading.Event()
#: The environment the test process started with (this module is imported by conftest, before any test).
_ENVIRON = dict(os.environ)
GROUP = Path(__file__).with_name("jobgroup.py")
MARK = "head_start"


class SessionEnded(RuntimeError):
    """A job's work or command asked for once the test session has ended."""


def job(name: str, *, heavy: bool = False) -> Callable[[Callable[[Path], Any]], Callable[[Path], Any]]:
    """Register ``work`` as job ``name``; a test that takes it says so with ``@pytest.mark.head_start(name)``.
    A ``heavy`` job loads the memory as well as a core (the benchmarks): it begins after the others."""

    def register(work: Callable[[Path], Any]) -> Callable[[Path], Any]:
        assert _JOBS.setdefault(name, work) is work, f"two jobs named {name!r}"
        if heavy:
            _HEAVY.add(name)
        return work

    return register


def last(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with those that take a job moved to the end, each part in its order."""
    return sorted(items, key=lambda item: any(True for _ in item.iter_markers(MARK)))  # a stable sort


def environ() -> dict[str, str]:
    """A copy of the environment the test process started with: what a job's commands are given."""
    return dict(_ENVIRON)


def wanted(items: Iterable[pytest.Item]) -> list[str]:
    """The registered jobs the selected tests take, in the order they will first take them, heavy ones last (a
    mark naming no job is left to that test's ``take`` to report)."""
    names: list[str] = []
    for item in items:
        for mark in item.iter_markers(MARK):
            if mark.args and mark.args[0] in _JOBS and mark.args[0] not in names:
                names.append(mark.args[0])
    return sorted(names, key=lambda name: name in _HEAVY)


def begin(names: list[str], base: Path) -> None:
    """Jobs' directories go under ``base``; start ``names``, one after another, in one background thread."""
    global _pool, _base
    with _lock:
        _base = base
        if names and _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="head-start")
        for name in names:
            if name not in _futures:
                assert _pool is not None
                _futures[name] = _pool.submit(_do, name)


def take(name: str, timeout: float = 900) -> Any:
    """Job ``name``'s result (its exception raised again): waited for when begun, else done now."""
    with _lock:
        future = _futures.get(name)
        mine = future is None
        if future is None:
            future = _futures[name] = Future()
    if mine:
        try:
            future.set_result(_do(name))
        except BaseException as exc:
            future.set_exception(exc)
    try:
        return future.result(timeout)
    except BaseException as exc:
        origin = _raised.get(name)
        if origin is None or origin[0] is not exc:
            raise
    raise origin[0].with_traceback(origin[1])  # from the job, not through the takes before this one


def _do(name: str) -> Any:
    if name not in _JOBS:
        raise LookupError(f"no head-start job named {name!r} (registered: {sorted(_JOBS)})")
    if _closing.is_set():
        raise SessionEnded(f"job {name} asked for after the session ended")
    directory = Path(tempfile.mkdtemp(prefix=f"headstart-{name}-", dir=_base))
    _directories.append(directory)
    try:
        return _JOBS[name](directory)
    except BaseException as exc:
        if isinstance(exc, Exception):
            exc.add_note(f"(raised by head-start job {name!r}: every test that takes it reports this)")
        _raised[name] = (exc, exc.__traceback__)
        raise


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)``, at the lowest CPU
    priority (the tests running meanwhile keep theirs: a job goes on in their idle time), with the
    environment the test process started with unless ``env`` is given, in a process group of its own that
    ends with the test process (``tests/helpers/jobgroup.py``); SessionEnded once the session has ended."""
    timeout = kwargs.pop("timeout", 900)
    kwargs.setdefault("env", environ())
    group = ["nice", "-n", "19", sys.executable, "-I", str(GROUP), str(os.getpid())]
    with _lock:  # finish() sets _closing under this lock: a command it does not see is never started
        if _closing.is_set():
            raise SessionEnded(f"{argv[0]}: not started, the test session has ended")
        proc = subprocess.Popen(
            [*group, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            **kwargs,
        )
        _running.add(proc)
    with proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end(proc)
            raise
        finally:
            with _lock:
                _running.discard(proc)
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def _end(proc: subprocess.Popen[str]) -> None:
    """Ask ``proc`` (jobgroup.py) to end its group; when it is gone already, SIGKILL what is left of the group."""
    proc.send_signal(signal.SIGTERM)
    if proc.poll() is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def finish() -> None:
    """At the session's end: jobs not started are dropped, running ones ended, every directory removed."""
    with _lock:
        _closing.set()
        running = list(_running)
        pool = _pool
    for proc in running:
        _end(proc)
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
    while _directories:
        shutil.rmtree(_directories.pop(), ignore_errors=True)
