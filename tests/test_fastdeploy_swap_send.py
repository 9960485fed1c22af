"""Swaps sent as they come off the engine's queue, under the faults of a hostile operator: a worker stopped
(``SIGSTOP``) while swaps wait on it, many swaps at once, a control task behind them. The queue loop keeps
taking tasks while a daemon is away, and every swap reported done moved its bytes on every rank.

Played as ``tests/test_fastdeploy_faults.py`` plays FastDeploy's engine (its queue, flags and control
queues; FastDeploy's own files with ``FASTDEPLOY_SRC``). Real daemons, real signals.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kvcached.status import read_status
from tests.conftest import DaemonFactory
from tests.helpers.procs import halt
from tests.test_fastdeploy_engine import GEOMETRY, blocks
from tests.test_fastdeploy_faults import fill, logs, served, views


def test_a_control_task_is_answered_while_a_swap_waits_on_a_stopped_worker(
    daemons: DaemonFactory, tmp_path: Path
) -> None:
    """Rank 0's worker is stopped (``SIGSTOP``; for 5 s at most). Swap ``a`` is taken and sent (its wait on the
    pool's thread), then swap ``b``, then a control request: the queue loop sends ``b`` waiting at most
    ``SEND_NOW_S`` and goes back to the queue, so the control request is answered while the worker is still
    stopped. Once it continues (right after), both swaps are reported and their bytes are in the CPU pool
    (swapped back in to other blocks, byte for byte)."""
    with served(daemons, tmp_path, KVCACHED_TASK_DEADLINE_S="30") as (engine, daemon):
        status = engine.fd.CacheStatus
        caches = views(daemon.instance)
        worker = read_status(daemon.instance)["ranks"][0]["pid"]
        resumed = threading.Timer(5.0, os.kill, (worker, signal.SIGCONT))
        try:
            fill(caches, [1, 2], seed=11)
            original = [blocks(c, [1, 2]) for c in caches]
            halt(worker)
            resumed.start()
            engine.queue.put_transfer_task((status.SWAP2CPU, "a", [21], [1], [0]))
            engine.until(engine.queue.empty, "swap a taken")
            time.sleep(0.3)  # a is sent; its wait runs on the pool's thread
            engine.queue.put_transfer_task((status.SWAP2CPU, "b", [22], [2], [1]))
            started = time.monotonic()
            replies = engine.control_request("sleep")
            answered = time.monotonic() - started
            assert [r["error_code"] for r in replies] == [200, 200]
            assert stopped(worker), f"the control request was answered only after {answered:.1f}s, the worker running"
            resumed.cancel()
            os.kill(worker, signal.SIGCONT)
            found: list[object] = []

            def collect() -> bool:
                data = engine.queue.get_transfer_done_signal()
                if data is not None:
                    found.append(data)
                return len(found) >= 2

            engine.until(collect, "both swaps reported", timeout=40)
            assert sorted((d[1], list(d[3]), list(d[4])) for d in found) == [("a", [1], [0]), ("b", [2], [1])]  # type: ignore[index]
            fill(caches, [1, 2, 5, 6], value=0)
            done = engine.task((status.SWAP2GPU, "back", [21, 22], [5, 6], [0, 1]))
            assert done[0][1] == "back" and [blocks(c, [5, 6]) for c in caches] == original
        finally:
            resumed.cancel()
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
            for cache in caches:
                cache.close()


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (``SIGSTOP``) now."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2] == "T"


@pytest.mark.parametrize(
    ("gpu", "cpu"),
    [([-1], [0]), ([1], "0")],
    ids=["negative", "string"],
)
def test_a_swap_in_whose_ids_are_not_ids_ends_the_rank_naming_it(
    daemons: DaemonFactory, tmp_path: Path, gpu: Any, cpu: Any
) -> None:
    """A SWAP2GPU whose block ids are not block ids can never be done, and FastDeploy's scheduler waits for
    its result holding ``request_release_lock`` (handlers.py's docstring): like any swap-in that cannot
    happen, it must end rank 0's drop-in with a line naming the task, not be skipped with the engine left
    waiting."""
    with served(daemons, tmp_path) as (engine, _):
        status = engine.fd.CacheStatus
        engine.queue.put_transfer_task((status.SWAP2GPU, "not-ids", [31], gpu, cpu))
        engine.until(lambda: engine.dropins[0].poll() is not None, "rank 0's drop-in ended", timeout=20)
        said = logs(engine)
        assert "not-ids" in said, said[-2000:]


def _results(engine: Any, count: int, timeout: float = 60.0) -> list[Any]:
    found: list[Any] = []

    def collect() -> bool:
        data = engine.queue.get_transfer_done_signal()
        if data is not None:
            found.append(data)
        return len(found) >= count

    engine.until(collect, f"{count} results", timeout=timeout)
    return found


@pytest.mark.parametrize("fault", ["worker-kill", "daemon-kill", "restart", "daemon-stop-1s"])
def test_swaps_queued_at_once_through_a_fault_are_reported_done_only_with_their_bytes_moved(
    daemons: DaemonFactory, tmp_path: Path, fault: str
) -> None:
    """Eight swap-outs put at once, then the fault as they are taken (rank 1's worker killed -9, the daemon
    killed -9 and started again, ``kvcached restart``, the daemon's processes stopped for 1 s), then the
    eight swapped back in to other blocks at once: every swap reported with its blocks moved their bytes on
    both ranks, none is reported with nothing moved (every daemon adopted the memory), and the drop-ins
    live. (``daemon-kill`` races the queue thread's send, which closes a connection the daemon's death
    broke, against the pool thread's wait on it: run it several times.)"""
    with served(daemons, tmp_path) as (engine, daemon):
        status = engine.fd.CacheStatus
        caches = views(daemon.instance)
        try:
            fill(caches, list(range(8)), seed=21)
            original = [blocks(c, list(range(8))) for c in caches]
            for i in range(8):
                engine.queue.put_transfer_task((status.SWAP2CPU, f"out{i}", [100 + i], [i], [i]))
            if fault == "worker-kill":
                os.kill(read_status(daemon.instance)["ranks"][1]["pid"], signal.SIGKILL)
            elif fault == "daemon-kill":
                daemon.kill9()
                args = [*GEOMETRY, "--num-blocks", "16", "--num-cpu-blocks", "8"]
                store = ["--storage-backend", "file", "--storage-path", str(tmp_path / "store")]
                daemons.start(daemon.instance, ranks=2, small=False, args=[*args, *store]).wait_ready(60)
            elif fault == "restart":
                assert daemons.cli("restart", "--instance", daemon.instance).returncode == 0
            else:
                pids = [daemon.proc.pid] + [r["pid"] for r in read_status(daemon.instance)["ranks"]]
                for pid in pids:
                    halt(pid)
                time.sleep(1.0)
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            out = _results(engine, 8)
            assert sorted((d[1], list(d[3]), list(d[4])) for d in out) == [(f"out{i}", [i], [i]) for i in range(8)]
            fill(caches, list(range(8, 16)), value=0)
            for i in range(8):
                engine.queue.put_transfer_task((status.SWAP2GPU, f"in{i}", [100 + i], [8 + i], [i]))
            back = _results(engine, 8)
            assert sorted(d[1] for d in back) == [f"in{i}" for i in range(8)]
            assert [blocks(c, list(range(8, 16))) for c in caches] == original
            assert all(proc.poll() is None for proc in engine.dropins)
        finally:
            for cache in caches:
                cache.close()


def test_a_swap_in_taken_once_a_rank_failed_ends_the_rank_and_is_never_reported(
    daemons: DaemonFactory, tmp_path: Path
) -> None:
    """Rank 1's worker killed (-9) four times within a minute: the rank FAILED and the daemon ended. A swap-in
    taken then is sent at once (no daemon: tried again on the pool's thread until its deadline, 4 s) and
    ends rank 0's drop-in naming it; the engine gets no result for it."""
    with served(daemons, tmp_path, KVCACHED_TASK_DEADLINE_S="4") as (engine, daemon):
        status = engine.fd.CacheStatus
        for _ in range(4):
            pid = read_status(daemon.instance)["ranks"][1]["pid"]
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while daemon.proc.poll() is None and read_status(daemon.instance)["ranks"][1]["pid"] in (pid, None):
                assert time.monotonic() < deadline, "no replacement worker"
                time.sleep(0.05)
        daemon.proc.wait(30)
        engine.queue.put_transfer_task((status.SWAP2GPU, "after-failed", [41], [3], [2]))
        deadline = time.monotonic() + 30
        while engine.dropins[0].poll() is None:
            assert time.monotonic() < deadline, "rank 0's drop-in did not end"
            assert engine.queue.get_transfer_done_signal() is None, "a swap-in was reported with no daemon"
            time.sleep(0.05)
        said = logs(engine)
        assert "swap in 'after-failed'" in said and "cannot be done" in said, said[-2000:]
        daemons.cli("doctor", "--clean", "--instance", daemon.instance)  # the memory the daemon kept, released


def test_a_pause_taken_behind_swaps_sent_to_a_stopped_worker_is_answered_only_once_they_are_reported(
    daemons: DaemonFactory, tmp_path: Path
) -> None:
    """Rank 1's worker stopped (SIGSTOP) for 3 s; eight swap-outs put at once, then ``pause``: the pause is
    answered only once all eight are reported (the engine then holds no task in flight), each with its
    blocks; a swap put while paused is dropped and logged; after ``resume`` a swap is served."""
    with served(daemons, tmp_path) as (engine, daemon):
        status = engine.fd.CacheStatus
        worker = read_status(daemon.instance)["ranks"][1]["pid"]
        halt(worker)
        threading.Timer(3.0, os.kill, (worker, signal.SIGCONT)).start()
        try:
            for i in range(8):
                engine.queue.put_transfer_task((status.SWAP2CPU, f"out{i}", [100 + i], [i], [i]))
            assert [r["error_code"] for r in engine.control_request("pause")] == [200, 200]
            ready: list[Any] = []
            while (data := engine.queue.get_transfer_done_signal()) is not None:
                ready.append(data)
            assert sorted((d[1], list(d[3])) for d in ready) == [(f"out{i}", [i]) for i in range(8)], ready
            assert engine.value("cache_task_inflight") == [0, 0]
            engine.queue.put_transfer_task((status.SWAP2CPU, "while-paused", [200], [9], [0]))
            engine.until(engine.queue.empty, "the task taken")
            assert [r["error_code"] for r in engine.control_request("resume")] == [200, 200]
            done = engine.task((status.SWAP2CPU, "after", [201], [10], [1]))
            assert done[0][1] == "after"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
        assert "SWAP2CPU task 'while-paused' taken while the transfer loop is paused" in logs(engine)


@pytest.mark.parametrize(
    ("gpu", "cpu"),
    [([2**40], [0]), ([99], [0]), ([1, 2], [0]), ([3] * 2000, list(range(8)) * 250)],
    ids=["past-int32", "out-of-range", "lengths-differ", "two-thousand-repeated"],
)
def test_a_swap_out_kvcached_refuses_is_reported_with_nothing_moved_and_the_loop_serves_on(
    daemons: DaemonFactory, tmp_path: Path, gpu: list[int], cpu: list[int]
) -> None:
    """A swap-out with ids kvcached refuses (one past int32, one past the cache, lists of different lengths, two
    thousand repeated ones), as the engine's own code could put it: reported with nothing moved (the engine keeps
    its GPU copies), the drop-ins live, and a control request and the next swap are served."""
    with served(daemons, tmp_path) as (engine, _):
        status = engine.fd.CacheStatus
        done = engine.task((status.SWAP2CPU, "refused", [51], gpu, cpu))
        assert done[0][1:] == ("refused", [], [], [])
        assert [r["error_code"] for r in engine.control_request("sleep")] == [200, 200]
        done = engine.task((status.SWAP2CPU, "next", [52], [1], [0]))
        assert done[0][1:] == ("next", [52], [1], [0])
        assert all(proc.poll() is None for proc in engine.dropins)
