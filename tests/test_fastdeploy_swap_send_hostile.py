"""The drop-in's queue loop sends each swap waiting at most ``SEND_NOW_S`` for a daemon that is away: also
when the stopped worker's socket is full (one large swap, or many ordinary ones), where the send itself
blocks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvcached.status import read_status
from tests.conftest import DaemonFactory
from tests.helpers.procs import halt
from tests.test_fastdeploy_faults import served


@pytest.mark.parametrize(("ids", "swaps"), [(48000, 1), (1000, 30)], ids=["one-large", "many"])
def test_a_control_task_is_answered_while_swaps_wait_on_a_stopped_workers_full_socket(
    daemons: DaemonFactory, tmp_path: Path, ids: int, swaps: int
) -> None:
    with served(daemons, tmp_path, "--worker-timeout", "120", stop_timeout=2, KVCACHED_TASK_DEADLINE_S="60") as (
        engine,
        daemon,
    ):
        status = engine.fd.CacheStatus
        worker = read_status(daemon.instance)["ranks"][0]["pid"]
        block_ids = list(range(8)) * (ids // 8)  # 16 bytes a block in the frame
        try:
            engine.task((status.SWAP2CPU, "small", [1], [1], [1]))  # the connections are open
            halt(worker)
            for i in range(swaps):
                engine.queue.put_transfer_task((status.SWAP2CPU, f"s{i}", list(range(ids)), block_ids, block_ids))
            engine.until(
                engine.queue.empty, "the swaps taken (the queue loop waits at most SEND_NOW_S a swap)", timeout=10
            )
            time.sleep(0.5)
            started = time.monotonic()
            replies = engine.control_request("sleep")
            answered = time.monotonic() - started
            assert [r["error_code"] for r in replies] == [200, 200]
            assert answered < 4.0, f"the control request was answered only after {answered:.1f}s (worker stopped)"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGCONT)


@pytest.mark.parametrize("fault", ["kill-worker", "restart"])
def test_a_storm_of_swaps_with_a_fault_and_a_control_request_in_the_middle_reports_each_once(
    daemons: DaemonFactory, tmp_path: Path, fault: str
) -> None:
    with served(daemons, tmp_path, KVCACHED_TASK_DEADLINE_S="10") as (engine, daemon):
        status = engine.fd.CacheStatus
        for i in range(20):
            engine.queue.put_transfer_task((status.SWAP2CPU, f"a{i}", [100 + i], [i % 16], [i % 8]))
        if fault == "kill-worker":
            os.kill(read_status(daemon.instance)["ranks"][1]["pid"], signal.SIGKILL)
        else:
            restart = subprocess.Popen(
                [sys.executable, "-m", "kvcached.cli", "restart", "--instance", daemon.instance], env=daemons.env()
            )
        assert [r["error_code"] for r in engine.control_request("sleep")] == [200, 200]
        for i in range(20):
            engine.queue.put_transfer_task((status.SWAP2CPU, f"b{i}", [200 + i], [i % 16], [i % 8]))
        found: list[tuple[Any, ...]] = []

        def collect() -> bool:
            while (data := engine.queue.get_transfer_done_signal()) is not None:
                found.append(tuple(data))
            return len(found) >= 40

        engine.until(collect, "every swap reported", timeout=60)
        time.sleep(1)
        collect()
        names = sorted(str(d[1]) for d in found)
        assert names == sorted([f"a{i}" for i in range(20)] + [f"b{i}" for i in range(20)]), names
        for d in found:
            name = str(d[1])
            i = int(name[1:])
            assert (list(d[3]), list(d[4])) in (([i % 16], [i % 8]), ([], [])), d
        assert all(proc.poll() is None for proc in engine.dropins)
        if fault == "restart":
            assert restart.wait(60) == 0
