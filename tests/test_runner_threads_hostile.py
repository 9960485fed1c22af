"""``CacheTasks`` shared by many threads, attacked: a close while another thread waits for a result, a
submit with a short deadline while the worker's socket is full, and a storm of tasks read out of order
(by other threads than their senders) with a worker killed in the middle."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import runner_client as rc
from kvcached.status import read_status
from tests.conftest import DaemonFactory
from tests.helpers.procs import frozen
from tests.test_runner_threads import BOUND_S, in_thread

DOCUMENTED = (rc.TaskLost, rc.TaskTimeout, rc.DaemonGone, rc.InvalidTask, rc.TaskFailed, rc.RankFailed)


def fds() -> int:
    """Descriptors open in this process, pipes left out: runner_client opens none, and a job of
    ``tests/helpers/headstart.py`` opens and closes its command's in the background whenever it starts one."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed since listed
            count += not os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:")
    return count


def test_close_while_another_thread_waits_for_a_result_raises_a_documented_error(daemons: DaemonFactory) -> None:
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    tasks = rc.CacheTasks(daemon.instance, timeout=30)
    assert tasks.swap_out(0, [0], [0]).blocks == 1
    worker = read_status(daemon.instance)["ranks"][0]["pid"]
    with frozen(worker):
        handle = tasks.submit(tasks.swap_out, 0, [1], [1])
        out: list[Any] = []

        def wait() -> None:
            try:
                out.append(handle.result())
            except BaseException as exc:
                out.append(exc)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()
        tasks.close()  # another thread closes the client while the result is awaited
        waiter.join(BOUND_S)
        assert not waiter.is_alive(), "result() still blocked after close()"
    assert isinstance(out[0], rc.KVCacheError), repr(out[0])


#: 800 kB of ids per task: a few fill the socket's buffers.
BIG = [0] * 100_000


@contextlib.contextmanager
def served_then_stopped(daemons: DaemonFactory) -> Iterator[rc.CacheTasks]:
    """A client of a one-rank daemon that served one swap, its worker stopped (``SIGSTOP``) while the block
    runs."""
    daemon = daemons.start(ranks=1, stop_timeout=2, args=["--worker-timeout", "120"])
    daemon.wait_ready()
    with rc.CacheTasks(daemon.instance, timeout=BOUND_S * 2) as tasks:
        assert tasks.swap_out(0, [0], [0]).blocks == 1
        with frozen(read_status(daemon.instance)["ranks"][0]["pid"]):
            yield tasks


def test_a_submit_with_a_short_timeout_is_bounded_while_the_workers_socket_is_full(daemons: DaemonFactory) -> None:
    with served_then_stopped(daemons) as tasks:
        filler = threading.Thread(
            target=lambda: [in_thread(lambda: tasks.submit(tasks.swap_out, 0, BIG, BIG, timeout=0.5))],
            daemon=True,
        )
        filler.start()
        time.sleep(1.0)
        began = time.monotonic()
        raised = in_thread(lambda: tasks.submit(tasks.swap_out, 0, [1], [1], timeout=0.05))
        took = time.monotonic() - began
        assert took < 5.0, f"a submit with timeout=0.05 took {took:.1f}s: {raised!r}"
        assert isinstance(raised[0], (rc.TaskTimeout, rc.TaskHandle)), raised


def test_a_submit_with_a_short_timeout_returns_by_then_alone_on_a_full_socket(daemons: DaemonFactory) -> None:
    with served_then_stopped(daemons) as tasks:
        began = time.monotonic()
        raised = in_thread(lambda: tasks.submit(tasks.swap_out, 0, BIG, BIG, timeout=0.5))
        took = time.monotonic() - began
        assert took < 5.0, f"a submit with timeout=0.5 took {took:.1f}s: {raised!r}"


@pytest.mark.parametrize("fault", ["kill-worker", "kill-daemon", "stop-worker", "restart", "close"])
def test_a_storm_of_tasks_from_many_threads_each_result_is_its_own(daemons: DaemonFactory, fault: str) -> None:
    daemon = daemons.start(ranks=2, stop_timeout=2)
    daemon.wait_ready()
    before = fds()
    tasks = rc.CacheTasks(daemon.instance, timeout=10)
    per_block = tasks.swap_out(None, [0], [0]).bytes
    handles: list[tuple[int, rc.TaskHandle]] = []
    lock = threading.Lock()
    bad: list[str] = []
    good: list[int] = []
    stop = time.monotonic() + 2.2  # the fault at 0.5 s, then most of a second of storm after it ends

    def submitter(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop:
            n = rng.randint(1, 4)
            try:
                h = tasks.submit(
                    tasks.swap_out,
                    rng.choice([0, 1, None]),
                    list(range(n)),
                    list(range(n)),
                    timeout=rng.choice([0.001, 0.05, 2.5]),
                )
            except DOCUMENTED:
                time.sleep(0.001)
                continue
            except BaseException as exc:
                bad.append(f"submit: {exc!r}")
                return
            with lock:
                handles.append((n, h))

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop + 1:
            with lock:
                if not handles and time.monotonic() > stop:
                    return  # the submitters have ended: every handle sent is taken
                item = (
                    handles.pop(rng.randrange(len(handles)))
                    if len(handles) > 150 or (handles and time.monotonic() > stop)
                    else None
                )
            if item is None:
                time.sleep(0.001)
                continue
            n, h = item
            if rng.random() < 0.1:
                continue  # abandoned
            began = time.monotonic()
            t = rng.choice([0.001, 0.05, 2.5])
            try:
                r = h.result(timeout=t)
            except DOCUMENTED:
                if time.monotonic() - began > t + 12:
                    bad.append(f"result(timeout={t}) took {time.monotonic() - began:.1f}s")
                continue
            except BaseException as exc:
                bad.append(f"result: {exc!r}")
                return
            if r.blocks != n or r.bytes != n * per_block:
                bad.append(f"wrong result: {n} blocks sent, got {r}")
            with lock:
                good.append(n)

    threads = [threading.Thread(target=submitter, args=(i,), daemon=True) for i in range(12)]
    threads += [threading.Thread(target=reader, args=(100 + i,), daemon=True) for i in range(12)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    status = read_status(daemon.instance)
    if fault == "kill-worker":
        os.kill(status["ranks"][1]["pid"], signal.SIGKILL)
    elif fault == "kill-daemon":
        daemon.kill9()
        daemon.proc.wait(30)
    elif fault == "stop-worker":
        with frozen(status["ranks"][0]["pid"]):
            time.sleep(1.0)
    elif fault == "restart":
        assert daemons.cli("restart", "--instance", daemon.instance).returncode == 0
    elif fault == "close":
        tasks.close()
    for t in threads:
        t.join(40)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    tasks.close()
    if fault == "kill-daemon":  # the memory the killed daemon kept, released
        daemons.cli("doctor", "--clean", "--instance", daemon.instance)
    print(f"{fault}: {len(good)} results checked")
    assert not bad, bad[:5]
    assert len(good) > 100, len(good)
    assert fds() <= before, f"fds {before} -> {fds()}"


def test_close_while_another_thread_opens_a_connection_leaves_no_connection_open(daemons: DaemonFactory) -> None:
    daemon = daemons.start(ranks=1, stop_timeout=2, args=["--worker-timeout", "120"])
    daemon.wait_ready()
    worker = read_status(daemon.instance)["ranks"][0]["pid"]
    before = fds()
    tasks = rc.CacheTasks(daemon.instance, timeout=10)
    out: list[Any] = []

    def submit() -> None:
        try:
            out.append(tasks.submit(tasks.swap_out, 0, [1], [1]))
        except BaseException as exc:
            out.append(exc)

    with frozen(worker):
        opener = threading.Thread(target=submit, daemon=True)
        opener.start()  # its HELLO waits for the stopped worker
        opener.join(1.0)
        assert opener.is_alive()
        tasks.close()
    opener.join(BOUND_S)
    assert not opener.is_alive()
    time.sleep(0.5)
    left = fds()
    assert left <= before, f"fds {before} -> {left} after close(): a connection opened during close() stays open"
    assert not isinstance(out[0], rc.TaskHandle), "a submit on a closed CacheTasks returned a handle"


def test_more_than_max_in_flight_submitted_and_read_in_reverse_each_result_is_its_own(daemons: DaemonFactory) -> None:
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    with rc.CacheTasks(daemon.instance, timeout=30) as tasks:
        per_block = tasks.swap_out(0, [0], [0]).bytes
        sizes = [1 + i % 4 for i in range(400)]
        handles = [tasks.submit(tasks.swap_out, 0, list(range(n)), list(range(n))) for n in sizes]
        for n, handle in reversed(list(zip(sizes, handles, strict=True))):
            assert handle.result().bytes == n * per_block


def test_past_max_in_flight_on_a_stopped_worker_a_submit_times_out_by_its_deadline(daemons: DaemonFactory) -> None:
    daemon = daemons.start(ranks=1, stop_timeout=2, args=["--worker-timeout", "120"])
    daemon.wait_ready()
    with rc.CacheTasks(daemon.instance, timeout=30) as tasks:
        assert tasks.swap_out(0, [0], [0]).blocks == 1
        with frozen(read_status(daemon.instance)["ranks"][0]["pid"]):
            handles = [tasks.submit(tasks.swap_out, 0, [1], [1], timeout=0.05) for _ in range(rc_max())]
            began = time.monotonic()
            raised = in_thread(lambda: tasks.submit(tasks.swap_out, 0, [1], [1], timeout=0.05))
            assert time.monotonic() - began < 2.0
            assert isinstance(raised[0], rc.TaskTimeout), raised
        assert all(h.result().blocks == 1 for h in handles)


def rc_max() -> int:
    from runner_client.connection import MAX_IN_FLIGHT

    return MAX_IN_FLIGHT


def test_replies_of_abandoned_handles_are_not_kept_forever(daemons: DaemonFactory) -> None:
    """A handle dropped unread (as after a ``TaskTimeout``: "the task may still complete") does not leave
    its reply in the connection's ``early`` map for ever."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    with rc.CacheTasks(daemon.instance, timeout=30) as tasks:
        for _ in range(1000):
            tasks.submit(tasks.swap_out, 0, [1], [1])  # abandoned
        assert tasks.swap_out(0, [0], [0]).blocks == 1
        connection = tasks._links[0]._connection
        assert connection is not None
        assert len(connection.early) < 1000, f"{len(connection.early)} replies kept for handles nobody holds"


def test_a_hello_cut_off_by_the_tasks_own_deadline_is_a_task_timeout_not_daemon_gone(daemons: DaemonFactory) -> None:
    """The daemon and its worker are alive (the worker stopped for a moment): a task whose deadline passes
    before the HELLO is answered timed out; ``DaemonGone`` would tell the runner to re-attach."""
    daemon = daemons.start(ranks=1, stop_timeout=2, args=["--worker-timeout", "120"])
    daemon.wait_ready()
    with rc.CacheTasks(daemon.instance, timeout=30) as tasks:
        with frozen(read_status(daemon.instance)["ranks"][0]["pid"]):
            raised = in_thread(lambda: tasks.swap_out(0, [1], [1], timeout=0.2))
        assert isinstance(raised[0], rc.TaskTimeout), repr(raised[0])


def test_a_reply_already_read_by_another_thread_is_returned_without_waiting_behind_its_read(
    daemons: DaemonFactory,
) -> None:
    """Thread A waits for task 2 (its worker stopped) and, on the way, read task 1's reply: task 1's result
    is there, and ``result()`` returns it at once instead of waiting for A's read to end."""
    daemon = daemons.start(ranks=1, stop_timeout=2, args=["--worker-timeout", "120"])
    daemon.wait_ready()
    with rc.CacheTasks(daemon.instance, timeout=30) as tasks:
        assert tasks.swap_out(0, [0], [0]).blocks == 1
        first = tasks.submit(tasks.swap_out, 0, [1], [1])
        time.sleep(0.5)  # answered: its reply waits in the socket
        with frozen(read_status(daemon.instance)["ranks"][0]["pid"]):
            second = tasks.submit(tasks.swap_out, 0, [2], [2])
            reader = threading.Thread(target=lambda: in_thread(lambda: second.result(timeout=10)), daemon=True)
            reader.start()  # reads first's reply on its way to second's, then blocks
            time.sleep(0.5)
            got = in_thread(lambda: first.result(timeout=2))
            assert isinstance(got[0], rc.TaskResult), f"the reply was read already, yet: {got[0]!r}"


def test_a_copy_of_a_handle_dropped_leaves_the_originals_reply(daemons: DaemonFactory) -> None:
    """A handle copied (``copy.copy`` / ``copy.deepcopy``) and one of the two dropped: the other still gets
    the task's result (a dropped handle tells its connections to drop the replies it did not read)."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    with rc.CacheTasks(daemon.instance, timeout=30) as tasks:
        for clone in (copy.copy, copy.deepcopy):
            handle = tasks.submit(tasks.swap_out, 0, [1], [1])
            kept = clone(handle)
            del handle
            gc.collect()
            got = in_thread(functools.partial(kept.result, timeout=5))
            assert isinstance(got[0], rc.TaskResult), f"{clone.__name__}: {got[0]!r}"


#: A runner interrupted by a signal every 20 ms (as under a sampling profiler) waits for a reply, then sends
#: frames to a worker that reads none: each gives up at its own timeout.
SIGNALLED_RUNNER = r"""
import json, signal, sys, time
import runner_client as rc
tasks = rc.CacheTasks(sys.argv[1], timeout=30)
tasks.swap_out(0, [0], [0])
print("connected", flush=True)
sys.stdin.readline()  # the worker is stopped now
signal.signal(signal.SIGALRM, lambda *_: None)
signal.setitimer(signal.ITIMER_REAL, 0.02, 0.02)
out = {}
for name, call in (
    ("reply", lambda: tasks.submit(tasks.swap_out, 0, [1], [1], timeout=0.5).result(timeout=0.5)),
    ("send", lambda: [tasks.submit(tasks.swap_out, 0, [0] * 100_000, [0] * 100_000, timeout=0.5) for _ in range(100)]),
):
    began = time.monotonic()
    try:
        call()
        out[name] = ["returned", time.monotonic() - began]
    except rc.KVCacheError as exc:
        out[name] = [type(exc).__name__, time.monotonic() - began]
print(json.dumps(out), flush=True)
"""


def test_a_runner_signalled_every_20_ms_still_times_out_its_reads_and_sends(daemons: DaemonFactory) -> None:
    """A socket's own receive and send timeouts start again whenever a signal interrupts the call: a runner
    signalled more often than that (a profiler's timer) waited for ever on a stopped worker. Each wait is
    bounded by its deadline, signals or not."""
    daemon = daemons.start(ranks=1, stop_timeout=2, args=["--worker-timeout", "120"])
    daemon.wait_ready()
    runner = subprocess.Popen(
        [sys.executable, "-c", SIGNALLED_RUNNER, daemon.instance],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=daemons.env(),
    )
    try:
        assert runner.stdout is not None and runner.stdin is not None
        assert runner.stdout.readline().strip() == "connected", runner.stderr
        with frozen(read_status(daemon.instance)["ranks"][0]["pid"]):
            runner.stdin.write("go\n")
            runner.stdin.flush()
            out, err = runner.communicate(timeout=60)
    finally:
        runner.kill()
        runner.wait()
    seen = json.loads(out.splitlines()[-1])
    for name in ("reply", "send"):
        what, took = seen[name]
        assert what == "TaskTimeout" and took < 5.0, (name, seen, err)
