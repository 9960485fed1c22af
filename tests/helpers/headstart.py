"""The slow work of a few tests, begun as soon as the session knows its tests, so a one-process run waits less.

Four jobs spend their time waiting on tools: pip building and installing the project (README's quickstart,
systemd/README.md's install steps, the wheel) and the benchmarks' smoke run; the tests marked
``@pytest.mark.head_start(name)`` take them. In a one-process session (``-n 0``, or no ``-n``) the other
tests leave the second core mostly idle, so that work runs there, in one background thread, in the order
the tests will take it, while the tests before them run. A test takes the result and asserts on it exactly
what it asserted on work it did itself: the same commands, the same checks; only the moment they run
differs. With several test processes (pytest-xdist) nothing is begun early: ``take`` does the work when it
is asked. ``tests/test_headstart.py`` checks both.

Invariants: a job runs at most once per test process, in a directory of its own; its result, or the
exception it raised, is what every ``take`` of it returns or raises; at the session's end a job still
running has its processes killed (those ``run`` started) and every job's directory is removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

#: name -> the work: called with an empty directory of its own, returns what ``take`` hands the test.
_JOBS: dict[str, Callable[[Path], Any]] = {}
_futures: dict[str, Future[Any]] = {}
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_running: set[subprocess.Popen[str]] = set()
_directories: list[Path] = []
_closing = threading.Event()
MARK = "head_start"


def job(name: str) -> Callable[[Callable[[Path], Any]], Callable[[Path], Any]]:
    """Register ``work`` as job ``name``; a test that takes it says so with ``@pytest.mark.head_start(name)``."""

    def register(work: Callable[[Path], Any]) -> Callable[[Path], Any]:
        assert _JOBS.setdefault(name, work) is work, f"two jobs named {name!r}"
        return work

    return register


def wanted(items: Iterable[pytest.Item]) -> list[str]:
    """The jobs the selected tests take, in the order they will first take them."""
    names: list[str] = []
    for item in items:
        for mark in item.iter_markers(MARK):
            if mark.args[0] not in names:
                names.append(mark.args[0])
    return names


def begin(names: list[str]) -> None:
    """Start ``names``, one after another, in one background thread."""
    global _pool
    unknown = [name for name in names if name not in _JOBS]
    assert not unknown, f"no job named {unknown}; registered: {sorted(_JOBS)}"
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(1, thread_name_prefix="head-start")
        for name in names:
            if name not in _futures:
                _futures[name] = _pool.submit(_do, name)


def take(name: str, timeout: float = 900) -> Any:
    """Job ``name``'s result (its exception raised again): waited for when begun, else done now."""
    with _lock:
        future = _futures.get(name)
        if future is None:
            future = _futures[name] = Future()
            mine = True
        else:
            mine = False
    if mine:
        try:
            future.set_result(_do(name))
        except BaseException as exc:
            future.set_exception(exc)
    return future.result(timeout)


def _do(name: str) -> Any:
    if _closing.is_set():
        raise RuntimeError(f"job {name} asked for after the session ended")
    directory = Path(tempfile.mkdtemp(prefix=f"kvcached-test-{name}-"))
    _directories.append(directory)
    return _JOBS[name](directory)


def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)``, at the lowest CPU
    priority (the tests running meanwhile keep theirs: a job goes on in their idle time), its process in a
    session of its own, killed with its group if the test session ends first."""
    timeout = kwargs.pop("timeout", 900)
    prefix = ["nice", "-n", "19"]
    if shutil.which("setpriv"):  # this thread waits for the process: its end is not the signal's cause
        prefix += ["setpriv", "--pdeathsig", "KILL", "--"]
    with subprocess.Popen(
        [*prefix, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    ) as proc:
        with _lock:
            _running.add(proc)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            raise
        finally:
            with _lock:
                _running.discard(proc)
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def _kill(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def finish() -> None:
    """At the session's end: jobs not started are dropped, running ones killed, every directory removed."""
    _closing.set()
    with _lock:
        for proc in _running:
            _kill(proc)
        pool = _pool
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
    while _directories:
        shutil.rmtree(_directories.pop(), ignore_errors=True)
