"""Run inside a private mount namespace whose /dev/shm is a small tmpfs (``tests/test_kept.py`` sets it up):
start a daemon whose cache takes over 60 % of that /dev/shm, fill it, kill -9 it, start again, and print
one JSON line: the fraction of /dev/shm the cache takes, the start's note, and whether the bytes are the
same. The namespace, and every object in its /dev/shm, goes when this ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from kvcached.status import is_ready, read_status
from tests.test_kill_steps import digests, fill

INSTANCE = "kvt-private-shm"
#: 2 ranks x (248 device blocks + 64 CPU blocks) x 64 KiB: 39 MiB of a 64 MiB /dev/shm.
GEOMETRY = ["--ranks", "2", "--num-layers", "4", "--kv-heads", "2", "--head-dim", "128", "--block-size", "16"]
BLOCKS = ["--num-blocks", "248", "--num-cpu-blocks", "64", "--log-format", "json"]


def start() -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "kvcached.cli", "start", "--instance", INSTANCE, *GEOMETRY, *BLOCKS]
    daemon = subprocess.Popen(command, stdout=sys.stderr, stderr=sys.stderr)
    deadline = time.monotonic() + 60
    while not is_ready(read_status(INSTANCE)):
        if daemon.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the daemon exited with {daemon.poll()} or was not ready in time")
        time.sleep(0.05)
    return daemon


def main() -> None:
    daemon = start()
    fill(INSTANCE, seed=13)
    before = digests(INSTANCE)
    st = os.statvfs("/dev/shm")
    fraction = sum(os.stat(f"/dev/shm/{name}").st_size for name in before) / (st.f_blocks * st.f_frsize)
    daemon.send_signal(signal.SIGKILL)
    daemon.wait()
    again = start()
    status = read_status(INSTANCE)
    same = digests(INSTANCE) == before
    again.send_signal(signal.SIGTERM)
    again.wait(30)
    print(json.dumps({"fraction": fraction, "note": status["note"], "same": same}))


if __name__ == "__main__":
    main()
