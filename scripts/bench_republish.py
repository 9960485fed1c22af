#!/usr/bin/env python3
"""Putting back what a Mooncake master forgot, beside the host's own tasks and a plain batch put, in one run.

Host A (one daemon of ``--ranks`` ranks, its keeper's default ``--mooncake-republish-rate`` unless ``--rate``)
stores ``--gib`` GiB of objects (blocks of 1 MiB) on a fresh ``mooncake_master``, then loads the last
``--batch`` of them once (so they are the most recently used). In the same run:

* baseline: A's own swap tasks (out to the CPU pool and back in, ``--batch`` blocks a task) and load tasks
  (those last objects, from A's segment) run side by side for ``--seconds``, nothing else going on;
* the master is killed -9 and started again without a snapshot: A's keeper puts every object back, most
  recently used first; while it does (as ``kvcached status`` says: objects to go), the same swap and load
  tasks run side by side again (the loads from when their objects are back, the first batch put back);
* once A has stopped (for good: its keeper lets go of its segment), a plain Mooncake client puts the same
  bytes (as many objects of the same size, 32 a ``batch_put_from`` call, into its own segment of the same
  size) into the same master.

Reported: the swap and load throughput while objects are put back against the baseline (target: at least
0.8 each), the put back's rate (its bytes over its duration, as the keeper logs it) and its ratio to the
plain batch put's. Timing on a shared machine drifts: compare the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402
from helpfmt import show_defaults  # noqa: E402

import runner_client as rc  # noqa: E402
from kvcached.status import read_status  # noqa: E402
from kvcached.store.mooncake_backend import MooncakeBackend  # noqa: E402
from tests.conftest import MooncakeMaster, free_port  # noqa: E402  (the master the tests start: killed, started again)

#: 4 layers x (key, value) x 8 heads x 64 tokens x 128 x 2 bytes: 1 MiB a block.
GEOMETRY = {"num_layers": 4, "kv_heads": 8, "head_dim": 128, "block_size": 64}
BLOCK = 1 << 20
HEADER = 128


class Tasks(threading.Thread):
    """Swap or load tasks of ``--batch`` blocks in a loop, each timed: (end, bytes moved)."""

    def __init__(self, instance: str, kind: str, blocks: int, hot: list[bytes], batch: int) -> None:
        super().__init__(daemon=True)
        self.instance, self.kind, self.blocks, self.hot, self.batch = instance, kind, blocks, hot, batch
        self.done: list[tuple[float, int]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        spare = list(range(self.blocks, self.blocks + self.batch))  # blocks past the stored ones
        with rc.CacheTasks(self.instance, timeout=60) as tasks:
            while not self.stopping.is_set():
                if self.kind == "swap":
                    moved = tasks.swap_out(None, spare, list(range(self.batch))).bytes
                    moved += tasks.swap_in(None, list(range(self.batch)), spare).bytes
                else:
                    moved = tasks.load(None, self.hot, spare).bytes
                self.done.append((time.monotonic(), moved))

    def rate(self, start: float, end: float) -> float:
        moved = sum(n for when, n in self.done if start < when <= end)
        return moved / (end - start)


def side_by_side(
    instance: str, blocks: int, hot: list[bytes], batch: int, until: Any, kinds: tuple[str, ...] = ("swap", "load")
) -> dict[str, float]:
    """Swap and load tasks (``kinds``) side by side until ``until()`` is true; bytes a second of each."""
    threads = {kind: Tasks(instance, kind, blocks, hot, batch) for kind in kinds}
    for thread in threads.values():
        thread.start()
    started = time.monotonic()
    while not until():
        time.sleep(0.02)
    ended = time.monotonic()
    for thread in threads.values():
        thread.stopping.set()
        thread.join(120)
    return {kind: thread.rate(started, ended) for kind, thread in threads.items()} | {"seconds": ended - started}


def keeper_pid(sock: Path) -> int:
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(sock))
        pid: int = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        return pid


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def figures(instance: str) -> list[dict[str, int]]:
    return [r["store"]["republish"] for r in read_status(instance)["ranks"]]


def plain_put(master: str, metadata: str, count: int, size: int, segment: int, out: Any) -> None:
    """A plain client puts ``count`` objects of ``size`` bytes, 32 a batch call, into its own segment."""
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    client = MooncakeDistributedStore()
    assert client.setup(f"127.0.0.1:{free_port()}", metadata, segment, 64 << 20, "tcp", "", master) == 0
    own = ReplicateConfig()
    own.preferred_segment = client.get_hostname()
    data = mmap.mmap(-1, 32 * size)
    data.write(b"\x03" * len(data))
    address = ctypes.addressof(ctypes.c_char.from_buffer(data))
    assert client.register_buffer(address, len(data)) == 0
    started = time.perf_counter()
    for i in range(0, count, 32):
        names = [f"plain/{j}" for j in range(i, min(count, i + 32))]
        ptrs = [address + k * size for k in range(len(names))]
        assert client.batch_put_from(names, ptrs, [size] * len(names), own) == [0] * len(names)
    out.put(time.perf_counter() - started)
    client.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of objects host A stores and gets back")
    parser.add_argument("--ranks", type=int, default=1, help="ranks of host A (the objects are split among them)")
    parser.add_argument("--batch", type=int, default=32, help="blocks a swap or load task moves")
    parser.add_argument("--seconds", type=float, default=4.0, help="how long the baseline runs")
    parser.add_argument("--rate", default=None, help="--mooncake-republish-rate (default: the option's default)")
    show_defaults(parser)
    args = parser.parse_args()
    rate = args.rate or next(k.default for k in MooncakeBackend.options if k.name == "mooncake_republish_rate")
    per_rank = int(args.gib * 1024) // args.ranks
    segment = (per_rank * (BLOCK + HEADER + 4096)) * 5 // 4 + (64 << 20)
    work = Path(tempfile.mkdtemp(prefix="kvcached-bench-republish-"))
    instance = f"bench-republish-{os.getpid()}"
    env = {**os.environ, "KVCACHED_RUN_DIR": str(work / "run")}
    master = MooncakeMaster(work / "mooncake_master.log")
    master.start()
    flags = benchlib.geometry_args(
        ranks=args.ranks, **GEOMETRY, num_blocks=per_rank + args.batch, num_cpu_blocks=args.batch
    )
    flags += ["--dtype", "bfloat16", "--storage-backend", "mooncake", "--mooncake-master", master.address]
    flags += ["--mooncake-metadata", master.metadata, "--mooncake-segment", str(segment), "--store-timeout", "60"]
    flags += ["--mooncake-republish-rate", str(rate)]
    daemon = benchlib.start_daemon(instance, env, flags)
    try:
        os.environ["KVCACHED_RUN_DIR"] = env["KVCACHED_RUN_DIR"]
        benchlib.wait_store(instance)
        keys = rc.block_keys(list(range(per_rank * GEOMETRY["block_size"])), GEOMETRY["block_size"])
        hot = keys[-args.batch :]
        with rc.CacheTasks(instance, timeout=300) as tasks:
            for start in range(0, per_rank, 256):
                ids = list(range(start, min(per_rank, start + 256)))
                tasks.store(None, ids, keys[start : start + len(ids)])
            assert tasks.load(None, hot, list(range(per_rank, per_rank + args.batch))).blocks == len(hot)
        print(f"host A: {per_rank * args.ranks} objects of {BLOCK >> 10} KiB stored; put back at {rate}/s")
        deadline = time.monotonic() + args.seconds
        baseline = side_by_side(instance, per_rank, hot, args.batch, lambda: time.monotonic() >= deadline)

        keeper = keeper_pid(work / "run" / f"{instance}.mooncake.sock")
        cpu = cpu_seconds(keeper)
        master.stop()
        master.start()
        with rc.CacheTasks(instance, timeout=300) as tasks:
            while tasks_lookup(tasks, hot) < len(hot):
                time.sleep(0.01)
        if not any(f["to_go"] for f in figures(instance)):
            raise SystemExit("the put back ended before the tasks began: store more (--gib) or lower --rate")
        during = side_by_side(
            instance, per_rank, hot, args.batch, lambda: not any(f["to_go"] for f in figures(instance))
        )
        cpu = cpu_seconds(keeper) - cpu
        log = (work / "run" / f"{instance}.mooncake.log").read_text().splitlines()
        events = {e["event"]: e for e in (json.loads(line) for line in log if line.startswith("{"))}
        back = events["the objects the master forgot are back"]
        forgot = events["the Mooncake master forgot every object of this segment"]["timestamp"]
        kept = next(e for k, e in events.items() if k.startswith("the master forgot"))["timestamp"]
        copied = (datetime.fromisoformat(kept) - datetime.fromisoformat(forgot)).total_seconds()
    finally:
        benchlib.stop_daemon(daemon)  # for good: the keeper lets go of its segment
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    plain = ctx.Process(
        target=plain_put, args=(master.address, master.metadata, per_rank * args.ranks, BLOCK + HEADER, segment, out)
    )
    plain.start()
    plain_s = out.get(timeout=600)
    plain.join()
    master.stop()
    shutil.rmtree(work, ignore_errors=True)

    mib = 1 << 20
    plain_rate = per_rank * args.ranks * (BLOCK + HEADER) / plain_s
    swap, load = baseline["swap"] / mib, baseline["load"] / mib
    print(f"baseline ({baseline['seconds']:.1f} s): swap {swap:.0f} MiB/s, load {load:.0f} MiB/s")
    print(
        f"while {back['done']} objects went back ({during['seconds']:.1f} s): swap {during['swap'] / mib:.0f} MiB/s "
        f"({during['swap'] / baseline['swap']:.2f} of the baseline), load {during['load'] / mib:.0f} MiB/s "
        f"({during['load'] / baseline['load']:.2f})"
    )
    print(
        f"put back: {back['bytes'] / mib:.0f} MiB in {back['seconds']:.2f} s, {back['rate'] / mib:.0f} MiB/s, "
        f"{cpu:.2f} s of the keeper's CPU (copies taken in {copied:.2f} s, before the "
        "tasks began); "
        f"plain batch put of the same bytes: {plain_rate / mib:.0f} MiB/s ({back['rate'] / plain_rate:.2f} of it)"
    )
    worst = min(during["swap"] / baseline["swap"], during["load"] / baseline["load"])
    print(f"target: the host's own tasks keep >= 0.8 of their throughput: {'met' if worst >= 0.8 else 'NOT met'}")
    return 0 if worst >= 0.8 else 1


def tasks_lookup(tasks: rc.CacheTasks, keys: list[bytes]) -> int:
    try:
        return tasks.lookup(keys)
    except rc.StoreUnavailable:
        return 0


if __name__ == "__main__":
    sys.exit(main())
