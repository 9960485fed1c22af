"""The distributed tier across hosts, for ``bench_store.py``: two daemons stand for two hosts on one fresh
``mooncake_master``.

* cross-host load: host A stores every block; host B loads them (its keeper fetches them from A's segment),
  beside plain Mooncake clients, one process per rank, fetching the very same objects with the batch call
  (``batch_get_into``, 32 objects a call) and with single ``get_into`` calls, alternating;
* a restarted host: while host B looks A's prefix up in a loop, A is restarted (``kvcached restart``), then
  killed -9 and started again; the lookups B made meanwhile (a miss is a lookup short of the whole
  prefix) and the time until A itself finds its whole prefix again.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import runner_client as rc
from kvcached.protocol.spec import CacheSpec
from kvcached.status import read_status

BATCH = 32


def plain_get(master: str, metadata: str, names: list[str], size: int, batched: bool, barrier: Any, out: Any) -> None:
    """One rank's plain client (no segment of its own): fetch ``names`` (objects in another host's segment)."""
    import mmap

    from mooncake.store import MooncakeDistributedStore

    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", metadata, 0, 64 << 20, "tcp", "", master) == 0
    data = np.frombuffer(mmap.mmap(-1, size * BATCH), dtype=np.uint8)
    client.register_buffer(data.ctypes.data, data.nbytes)
    ptrs = [data.ctypes.data + j * size for j in range(BATCH)]
    barrier.wait()
    started = time.perf_counter()
    for i in range(0, len(names), BATCH if batched else 1):
        if batched:
            chunk = names[i : i + BATCH]
            got = client.batch_get_into(chunk, ptrs[: len(chunk)], [size] * len(chunk))
        else:
            chunk, got = names[i : i + 1], [client.get_into(names[i], ptrs[0], size)]
        if got != [size] * len(chunk):
            out.put(f"plain get of {chunk[0]}...: {got}")
            break
    else:
        out.put(time.perf_counter() - started)
    client.close()


def run_plain_gets(master: str, metadata: str, names: list[list[str]], size: int, batched: bool) -> float:
    """Every rank's plain client at once; seconds of the slowest."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(len(names) + 1), ctx.Queue()
    procs = [ctx.Process(target=plain_get, args=(master, metadata, n, size, batched, barrier, out)) for n in names]
    for p in procs:
        p.start()
    barrier.wait()
    times = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    failed = [t for t in times if isinstance(t, str)]
    if failed:
        raise SystemExit(failed[0])
    return max(times)


def pipelined(instance: str, op: str, keys: list[bytes], batch: int) -> float:
    """Seconds to store (``op="store"``) or load every block, tasks of ``batch`` blocks sent at once."""
    ids = list(range(len(keys)))
    with rc.CacheTasks(instance, timeout=3600) as tasks:
        started = time.perf_counter()
        if op == "store":
            handles = [tasks.submit(tasks.store, None, ids[i : i + batch], keys[i : i + batch]) for i in ids[::batch]]
        else:
            handles = [tasks.submit(tasks.load, None, keys[i : i + batch], ids[i : i + batch]) for i in ids[::batch]]
        moved = sum(h.result().blocks for h in handles)
        took = time.perf_counter() - started
    assert moved == len(keys), f"{op}: {moved} of {len(keys)} blocks"
    return took


class Lookups(threading.Thread):
    """Host B looking up a prefix in a loop: (time, blocks found) of each lookup."""

    def __init__(self, instance: str, keys: list[bytes]) -> None:
        super().__init__(daemon=True)
        self.instance, self.keys = instance, keys
        self.seen: list[tuple[float, int]] = []
        self.errors = 0
        self.stop = threading.Event()

    def run(self) -> None:
        with rc.CacheTasks(self.instance, timeout=60) as tasks:
            while not self.stop.is_set():
                try:
                    found = tasks.lookup(self.keys)
                except rc.KVCacheError:
                    self.errors += 1
                    found = -1
                self.seen.append((time.monotonic(), found))
                time.sleep(0.005)

    def summary(self) -> dict[str, Any]:
        times = [t for t, _ in self.seen]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        short = sum(1 for _, found in self.seen if found != len(self.keys))
        return {"lookups": len(self.seen), "short": short, "errors": self.errors, "longest_gap_s": max(gaps or [0])}


def served_after(instance: str, keys: list[bytes], since: float, timeout: float = 120) -> float:
    """Seconds from ``since`` until ``instance`` itself finds the whole prefix."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with rc.CacheTasks(instance, timeout=10) as tasks:
                if tasks.lookup(keys) == len(keys):
                    return time.monotonic() - since
        except rc.KVCacheError:
            pass
        time.sleep(0.01)
    raise SystemExit(f"{instance} did not find its prefix again within {timeout:.0f}s")


def restarts(a: Any, b: str, keys: list[bytes], env: dict[str, str], start: Callable[[], Any]) -> dict[str, Any]:
    """Restart host A twice (``kvcached restart``; kill -9 and start) while host B looks its prefix up."""
    figures = {}
    for how in ("restart", "kill -9 + start"):
        watch = Lookups(b, keys)
        watch.start()
        time.sleep(0.3)
        since = time.monotonic()
        if how == "restart":
            cli = [sys.executable, "-m", "kvcached.cli", "restart", "--instance", a.instance]
            subprocess.run(cli, env=env, check=True, capture_output=True)
        else:
            a.proc.send_signal(signal.SIGKILL)
            a.proc.wait()
            a.proc = start()
        figures[how] = {"served_after_s": served_after(a.instance, keys, since)}
        time.sleep(0.3)
        watch.stop.set()
        watch.join()
        figures[how].update(watch.summary())
    return figures


class Host:
    def __init__(self, instance: str, proc: Any) -> None:
        self.instance, self.proc = instance, proc


def cross_host(
    work: Path,
    env: dict[str, str],
    args: Any,
    blocks: int,
    block_bytes: int,
    block_size: int,
    *,
    master: Callable[[Path], Any],
    daemon: Callable[[str, dict[str, str], int, int, int, list[str]], Any],
    segment: int,
) -> dict[str, Any]:
    """Host A stores, host B loads, plain clients fetch the same objects; then A restarts under B's lookups."""
    with master(work / "hosts-master.log") as (address, metadata):
        flags = ["--storage-backend", "mooncake", "--mooncake-master", address, "--mooncake-metadata", metadata]
        a_name, b_name = f"bench-a-{os.getpid()}", f"bench-b-{os.getpid()}"
        a_flags = [*flags, "--mooncake-segment", str(segment)]

        def start_a() -> Any:
            return daemon(a_name, env, args.ranks, blocks, block_size, a_flags)

        hosts: list[Host] = []  # each stopped at the end, however it comes
        try:
            a = Host(a_name, start_a())
            hosts.append(a)
            b_flags = [*flags, "--mooncake-segment", "64MiB"]
            b = Host(b_name, daemon(b_name, env, args.ranks, blocks, block_size, b_flags))
            hosts.append(b)
            keys = rc.block_keys(list(range(blocks)), 1)
            store_s = pipelined(a.instance, "store", keys, args.batch)
            digest = CacheSpec.from_dict(read_status(a.instance)["spec"]).geometry_digest.hex()
            names = [[f"kvcached/{digest}/{k.hex()}/r{r}" for k in keys] for r in range(args.ranks)]
            passes = []
            for _ in range(args.repeats):
                batched = run_plain_gets(address, metadata, names, block_bytes + 128, batched=True)
                load = pipelined(b.instance, "load", keys, args.batch)
                single = run_plain_gets(address, metadata, names, block_bytes + 128, batched=False)
                passes.append({"load_s": load, "batched_get_s": batched, "single_get_s": single})
            restarted = restarts(a, b.instance, keys, env, start_a)
        finally:
            for host in hosts:
                host.proc.terminate()
                host.proc.wait(60)
    return {"bytes": args.ranks * blocks * block_bytes, "store_s": store_s, "passes": passes, "restarts": restarted}


def gbps(figures: dict[str, Any], key: str) -> float:
    """Median GB/s over the passes of ``cross_host``'s figures, from the seconds under ``key``."""
    return statistics.median(figures["bytes"] / p[key] / 1e9 for p in figures["passes"])


#: The cross-host load's median ratio to reach: >= 0.9 of the plain batch_get_into of the same objects.
CROSS_HOST_TARGET = 0.9


def met(figures: dict[str, Any]) -> bool:
    """Whether ``cross_host``'s figures meet ``CROSS_HOST_TARGET``."""
    return statistics.median(p["batched_get_s"] / p["load_s"] for p in figures["passes"]) >= CROSS_HOST_TARGET


def report(figures: dict[str, Any]) -> list[str]:
    """The printout of ``cross_host``'s figures."""
    passes, total = figures["passes"], figures["bytes"]

    ratios = sorted(p["batched_get_s"] / p["load_s"] for p in passes)
    verdict = "met" if met(figures) else "NOT met"
    single = sorted(p["single_get_s"] / p["load_s"] for p in passes)
    lines = [
        "cross-host: host A stores, host B loads (its keeper fetches from A's segment), GB/s aggregate;",
        "  beside plain clients fetching the same objects, one process per rank; ratio = kvcached / plain",
        f"  B loads A's blocks {gbps(figures, 'load_s'):.2f} | plain batch_get_into "
        f"{gbps(figures, 'batched_get_s'):.2f}: "
        f"ratio {statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}] | plain get_into "
        f"{gbps(figures, 'single_get_s'):.2f}: ratio {statistics.median(single):.2f}",
        f"  target (>= {CROSS_HOST_TARGET:g} of the plain batch_get_into, median): {verdict}",
        f"  (A stored them at {total / figures['store_s'] / 1e9:.2f} GB/s)",
        "host A restarted while host B looks its prefix up every 5 ms:",
    ]
    for how, r in figures["restarts"].items():
        lines.append(
            f"  {how:<16} B: {r['lookups']} lookups, {r['short']} short of the whole prefix, {r['errors']} errors, "
            f"longest gap {r['longest_gap_s'] * 1000:.0f} ms; A finds its whole prefix again after "
            f"{r['served_after_s']:.2f} s"
        )
    return lines


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nNot run on its own: `scripts/bench_store.py --backends mooncake` runs it after its own passes.")
    sys.exit(0 if set(sys.argv[1:]) <= {"-h", "--help"} else 2)
