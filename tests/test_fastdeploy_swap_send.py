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

from kvcached.status import read_status
from tests.conftest import DaemonFactory
from tests.test_fastdeploy_engine import blocks
from tests.test_fastdeploy_faults import fill, served, views


def test_a_control_task_is_answered_while_a_swap_waits_on_a_stopped_worker(
    daemons: DaemonFactory, tmp_path: Path
) -> None:
    """Rank 0's worker is stopped (``SIGSTOP``) for 8 s. Swap ``a`` is taken and sent (its wait on the pool's
    thread), then swap ``b``, then a control request: the queue loop sends ``b`` waiting at most
    ``SEND_NOW_S`` and goes back to the queue, so the control request is answered while the worker is still
    stopped. Once it continues, both swaps are reported and their bytes are in the CPU pool (swapped back in
    to other blocks, byte for byte)."""
    with served(daemons, tmp_path, KVCACHED_TASK_DEADLINE_S="30") as (engine, daemon):
        status = engine.fd.CacheStatus
        caches = views(daemon.instance)
        worker = read_status(daemon.instance)["ranks"][0]["pid"]
        try:
            fill(caches, [1, 2], seed=11)
            original = [blocks(c, [1, 2]) for c in caches]
            os.kill(worker, signal.SIGSTOP)
            resumed = threading.Timer(8.0, os.kill, (worker, signal.SIGCONT))
            resumed.start()
            engine.queue.put_transfer_task((status.SWAP2CPU, "a", [21], [1], [0]))
            engine.until(engine.queue.empty, "swap a taken")
            time.sleep(0.3)  # a is sent; its wait runs on the pool's thread
            engine.queue.put_transfer_task((status.SWAP2CPU, "b", [22], [2], [1]))
            started = time.monotonic()
            replies = engine.control_request("sleep")
            answered = time.monotonic() - started
            assert [r["error_code"] for r in replies] == [200, 200]
            assert answered < 4.0, f"the control request was answered only after {answered:.1f}s (worker stopped)"
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
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)
            for cache in caches:
                cache.close()
