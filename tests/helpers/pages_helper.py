"""Run inside a private mount namespace whose /dev/shm is a fresh tmpfs (``tests/test_pages.py`` sets it up):
start a daemon, let a runner swap through it, and report what page size its arenas and pools got.

argv[1]: JSON {"instance", "run_dir", "args": [start flags]}. Prints one JSON line: the doctor's huge_pages
check, the bytes of each arena / pool mapped with 2 MiB pages in the worker (from /proc/<pid>/smaps), and
whether the swap round trip was byte-exact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import runner_client as rc
from kvcached.status import is_ready, read_status

ROOT = Path(__file__).resolve().parents[2]


def mapped(pid: int, instance: str) -> dict[str, dict[str, int]]:
    """Per /dev/shm object of ``instance`` mapped in ``pid``: its bytes mapped (``Size``), those in the page
    tables (``Rss``) and those mapped with huge pages (``Pmd``)."""
    found: dict[str, dict[str, int]] = {}
    current = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 6:
            current = Path(fields[5]).name if f"kvcached.{instance}." in fields[5] else None
            if current:
                found.setdefault(current, {"Size": 0, "Rss": 0, "Pmd": 0})
        elif current and fields[0] in ("Size:", "Rss:", "ShmemPmdMapped:", "FilePmdMapped:"):
            key = fields[0].rstrip(":") if fields[0] in ("Size:", "Rss:") else "Pmd"
            found[current][key] += int(fields[1]) * 1024
    return found


def file_bytes(name: str) -> int:
    """The size of /dev/shm object ``name`` (a mapping may run past it to a page boundary)."""
    return (Path("/dev/shm") / name).stat().st_size


def main() -> None:
    request: dict[str, Any] = json.loads(sys.argv[1])
    instance, env = request["instance"], dict(os.environ, KVCACHED_RUN_DIR=request["run_dir"])
    os.environ["KVCACHED_RUN_DIR"] = request["run_dir"]
    command = [sys.executable, "-m", "kvcached.cli"]
    doctor = subprocess.run(
        [*command, "doctor", "--json", "--instance", instance, *request["args"]],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    daemon = subprocess.Popen(
        [*command, "start", "--instance", instance, *request["args"]], env=env, cwd=ROOT, stderr=subprocess.PIPE
    )
    result: dict[str, Any] = {"huge_pages": checks["huge_pages"]}
    try:
        deadline = time.monotonic() + 60
        while not is_ready(read_status(instance)):
            assert daemon.poll() is None and time.monotonic() < deadline, daemon.stderr.read() if daemon.stderr else ""
            time.sleep(0.05)
        pid = read_status(instance)["ranks"][0]["pid"]
        spec = rc.CacheSpec(**request["spec"])
        cache = rc.initialize_kv_cache(spec, 0, instance=instance, timeout=10)
        raw = cache.key_caches[0].view(np.uint8)
        raw[3] = np.random.default_rng(1).integers(0, 256, raw[3].shape, dtype=np.uint8)
        with rc.CacheTasks(instance) as tasks:
            tasks.swap_out(0, [3], [1])
            tasks.swap_in(0, [1], [5])
        result["swap_exact"] = bool(np.array_equal(raw[3], raw[5]))
        deadline = time.monotonic() + 10  # the pages are mapped in the background once READY: until all are
        while True:
            objects = mapped(pid, instance)
            result["pmd_bytes"] = {name: v["Pmd"] for name, v in objects.items()}
            arenas = {name: v for name, v in objects.items() if name.endswith((".dev", ".cpu"))}
            done = len(arenas) == 2 and all(v["Rss"] >= min(v["Size"], file_bytes(name)) for name, v in arenas.items())
            if time.monotonic() > deadline or done:
                break
            time.sleep(0.1)
        cache.close()
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
