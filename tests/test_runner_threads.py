"""``CacheTasks`` shared by threads, against a real daemon whose worker is stopped (``SIGSTOP``): a thread
that sends a task never waits behind another thread that waits for a reply on the same connection, and a
task's own deadline bounds the connection's HELLO. (The FastDeploy drop-in sends swaps on its queue
thread while its pool threads wait for replies.)"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import runner_client as rc
from kvcached.status import read_status
from tests.conftest import DaemonFactory
from tests.helpers.procs import frozen, halt

#: Generous: each call below returns in milliseconds when it works, and not before a 60 s timeout when not.
BOUND_S = 15.0


def in_thread(call: Callable[[], Any]) -> list[Any]:
    """Run ``call`` in a thread for at most ``BOUND_S``: ``[result]`` or ``[exception]``; fails if it is
    still running then."""
    return [finish(in_thread_started(call))]


@contextlib.contextmanager
def connected(daemons: DaemonFactory) -> Iterator[tuple[rc.CacheTasks, int]]:
    """A one-rank daemon's ``CacheTasks`` (60 s timeout) with its connection open, and the rank worker's pid."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    with rc.CacheTasks(daemon.instance, timeout=60) as tasks:
        assert tasks.swap_out(0, [0], [0]).blocks == 1
        yield tasks, read_status(daemon.instance)["ranks"][0]["pid"]


def test_a_send_never_waits_behind_another_threads_wait_for_a_reply(daemons: DaemonFactory) -> None:
    with connected(daemons) as (tasks, worker):
        with frozen(worker):
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
    with rc.CacheTasks(daemon.instance, timeout=60) as tasks, frozen(worker):
        raised = in_thread(lambda: tasks.swap_out(0, [1], [1], timeout=timeout))
        assert isinstance(raised[0], rc.KVCacheError), raised
    with rc.CacheTasks(daemon.instance, timeout=60) as tasks:
        assert tasks.swap_out(0, [1], [1]).blocks == 1  # the worker serves once it runs again


def test_threads_reading_one_handle_all_get_its_outcome(daemons: DaemonFactory) -> None:
    """Several threads call ``result()`` on one handle at once (a pool's threads sharing a task): each gets
    the task's result, or for a task the daemon refused each gets that refusal; none waits out its timeout
    for a reply another thread has read."""
    daemon = daemons.start(ranks=2)
    daemon.wait_ready()
    readers = 4
    with rc.CacheTasks(daemon.instance, timeout=BOUND_S) as tasks:
        for round_ in range(40):
            handle = tasks.submit(tasks.swap_out, None, [1 + round_ % 4], [round_ % 4])
            barrier = threading.Barrier(readers)

            def read(handle: rc.TaskHandle = handle, barrier: threading.Barrier = barrier) -> Any:
                barrier.wait()
                return handle.result()

            outcomes = [in_thread_started(read) for _ in range(readers)]
            got = [finish(outcome) for outcome in outcomes]
            assert all(isinstance(g, rc.TaskResult) and g.blocks == 1 for g in got), (round_, got)
        refused = tasks.submit(tasks.store, None, [1], [bytes(32)])  # this daemon has no store
        barrier = threading.Barrier(readers)

        def read_refused() -> Any:
            barrier.wait()
            return refused.result()

        got = [finish(outcome) for outcome in [in_thread_started(read_refused) for _ in range(readers)]]
        assert all(isinstance(g, rc.InvalidTask) for g in got), got


def test_a_thread_waiting_behind_another_for_one_handle_keeps_its_own_timeout(daemons: DaemonFactory) -> None:
    """Two threads wait for one handle whose worker is stopped: the one with the shorter timeout gets
    TaskTimeout at its own deadline (not when the other, reading the replies, gives up); once the worker
    runs again, the other gets the result, and so does a later call from the first."""
    with connected(daemons) as (tasks, worker):
        with frozen(worker):
            handle = tasks.submit(tasks.swap_out, 0, [1], [1])
            reader = in_thread_started(handle.result)  # 60 s: it reads the replies, which cannot come yet
            reader[0].join(0.3)
            assert reader[0].is_alive()
            started = time.monotonic()
            short = in_thread(lambda: handle.result(timeout=0.5))
            assert isinstance(short[0], rc.TaskTimeout), short
            assert time.monotonic() - started >= 0.5
        assert finish(reader).blocks == 1
        assert handle.result(timeout=5).blocks == 1


def in_thread_started(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """``call`` running in a thread: (the thread, where its result or exception will be)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except Exception as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def finish(started: tuple[threading.Thread, list[Any]]) -> Any:
    """What ``in_thread_started``'s call returned or raised; fails if it runs longer than ``BOUND_S``."""
    thread, out = started
    thread.join(BOUND_S)
    assert not thread.is_alive(), f"still blocked after {BOUND_S:.0f}s"
    return out[0]


def test_threads_reading_one_handle_whose_worker_dies_all_get_task_lost(daemons: DaemonFactory) -> None:
    """README: several threads may call ``result()`` on one handle and each gets the task's result or its
    error, also the error no reply carries: the rank's worker killed during the task (stopped, then
    kill -9), every reader gets ``TaskLost``, none waits out its timeout."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    readers = 4
    with rc.CacheTasks(daemon.instance, timeout=60) as tasks:
        assert tasks.swap_out(0, [0], [0]).blocks == 1  # the connection is open
        worker = read_status(daemon.instance)["ranks"][0]["pid"]
        halt(worker)
        handle = tasks.submit(tasks.swap_out, 0, [1], [1])
        barrier = threading.Barrier(readers + 1)

        def read() -> Any:
            barrier.wait()
            return handle.result()

        outcomes = [in_thread_started(read) for _ in range(readers)]
        barrier.wait()
        os.kill(worker, signal.SIGKILL)
        got = [finish(outcome) for outcome in outcomes]
        assert all(isinstance(g, rc.TaskLost) for g in got), got
        assert tasks.swap_out(0, [1], [1]).blocks == 1  # the replaced worker serves


def test_threads_opening_a_ranks_connection_at_once_leave_one_open(daemons: DaemonFactory) -> None:
    """Sixteen threads send their first task at the same moment, so each finds the rank with no connection
    and opens one: one connection stays, the others are closed at once (none is left open, unreferenced by
    the client, until a garbage collection closes it), and every task gets its own result."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()

    def sockets() -> int:
        found = 0
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                found += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        return found

    gc.collect()  # sockets earlier tests left unreferenced close now, not while this one counts
    before = sockets()
    with rc.CacheTasks(daemon.instance, timeout=30) as tasks:
        start = threading.Barrier(16)
        handles: list[rc.TaskHandle] = []  # held: a connection a handle's task went out on stays referenced

        def first_task(block: int) -> None:
            start.wait()
            handles.append(tasks.submit(tasks.swap_out, 0, [block % 8], [block % 4]))

        threads = [threading.Thread(target=first_task, args=(i,)) for i in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(BOUND_S)
        assert len(handles) == 16 and all(handle.result().blocks == 1 for handle in handles)
        assert sockets() - before == 1
    assert sockets() == before
