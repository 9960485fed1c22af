"""What an operator sees: allocation progress on a terminal, and `kvcached status --watch`."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time

import runner_client as rc
from tests.conftest import ROOT, DaemonFactory, unique_instance


def test_start_on_a_terminal_shows_per_rank_progress(daemons: DaemonFactory) -> None:
    instance = unique_instance()
    daemons.instances.add(instance)
    master, slave = pty.openpty()
    args = ["--ranks", "2", "--num-layers", "4", "--kv-heads", "2", "--head-dim", "128", "--block-size", "64"]
    args += ["--num-blocks", "256", "--num-cpu-blocks", "64"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcached.cli", "start", "--instance", instance, *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=daemons.env(),
        cwd=ROOT,
    )
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while b"all ranks ready" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    seen += os.read(master, 65536)
                except OSError:
                    break
        text = seen.decode(errors="replace")
        assert "all ranks ready" in text, text
        progress = [line for line in text.splitlines() if line.startswith("allocating: ")]
        assert progress, text
        assert "GiB reserved" in progress[-1] and "[r0 " in progress[-1] and "r1 " in progress[-1]
        assert any("2/2 ranks ready" in line and "r0 ready r1 ready" in line for line in progress), progress
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        os.close(master)
    assert proc.returncode == 0


def test_status_watch_refreshes_with_rates_until_interrupted(daemons: DaemonFactory) -> None:
    daemon = daemons.start(ranks=2)
    daemon.wait_ready()
    stop = threading.Event()

    def swapping() -> None:
        with rc.CacheTasks(daemon.instance) as tasks:
            while not stop.is_set():
                tasks.swap_out(None, [0, 1], [0, 1])
                time.sleep(0.005)

    worker = threading.Thread(target=swapping)
    worker.start()
    watch = subprocess.Popen(
        [sys.executable, "-m", "kvcached.cli", "status", "--watch", "--interval", "0.2", "--instance", daemon.instance],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=daemons.env(),
        cwd=ROOT,
    )
    try:
        time.sleep(2.0)
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=20)
    finally:
        stop.set()
        worker.join(20)
    assert watch.returncode == 0, err
    frames = out.count("(every 0.2 s; Ctrl-C to stop)")
    assert frames >= 4, out
    assert "out/s" in out and ("KiB/s" in out or "MiB/s" in out), out
    assert "\x1b[2J" not in out, "no terminal codes when stdout is not a terminal"
