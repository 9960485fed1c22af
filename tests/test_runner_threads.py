"""``CacheTasks`` shared by threads, against a real daemon whose worker is stopped (``SIGSTOP``): a thread
that sends a task never waits behind another thread that waits for a reply on the same connection, and a
task's own deadline bounds the connection's HELLO. (The FastDeploy drop-in sends swaps on its queue
thread while its pool threads wait for replies.)"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import runner_client as rc
from kvcached.status import read_status
from tests.conftest import DaemonFactory

#: Generous: each call below returns in milliseconds when it works, and not before a 60 s timeout when not.
BOUND_S = 15.0


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def in_thread(call: Callable[[], Any]) -> list[Any]:
    """Run ``call`` in a thread for at most ``BOUND_S``: ``[result]`` or ``[exception]``; fails if it is
    still running then."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive(), f"still blocked after {BOUND_S:.0f}s"
    return out


def test_a_send_never_waits_behind_another_threads_wait_for_a_reply(daemons: DaemonFactory) -> None:
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    with rc.CacheTasks(daemon.instance, timeout=60) as tasks:
        assert tasks.swap_out(0, [0], [0]).blocks == 1  # the connection is open
        worker = read_status(daemon.instance)["ranks"][0]["pid"]
        with stopped(worker):
            first = tasks.submit(tasks.swap_out, 0, [1], [1])
            waiting = threading.Thread(target=first.result, daemon=True)
            waiting.start()  # reads the connection for its reply, which cannot come
            waiting.join(0.5)
            assert waiting.is_alive()
            second = in_thread(lambda: tasks.submit(tasks.swap_out, 0, [2], [2]))
            assert isinstance(second[0], rc.TaskHandle), second
        waiting.join(BOUND_S)
        assert first.result().blocks == 1 and second[0].result().blocks == 1


@pytest.mark.parametrize("timeout", [0.2, 1.0])
def test_a_tasks_timeout_bounds_the_hello_of_a_new_connection(daemons: DaemonFactory, timeout: float) -> None:
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    worker = read_status(daemon.instance)["ranks"][0]["pid"]
    with rc.CacheTasks(daemon.instance, timeout=60) as tasks, stopped(worker):
        raised = in_thread(lambda: tasks.swap_out(0, [1], [1], timeout=timeout))
        assert isinstance(raised[0], rc.KVCacheError), raised
    with rc.CacheTasks(daemon.instance, timeout=60) as tasks:
        assert tasks.swap_out(0, [1], [1]).blocks == 1  # the worker serves once it runs again
