"""The file store's part of ``bench_store.py``: store, warm load and cold load through a daemon, beside plain
file I/O of the same bytes and, with ``--lmcache PYTHON``, LMCache's local disk backend
(``bench_lmcache.py``), one after the other in each pass.

* store: kvcached ``store`` tasks (each object fsynced, then renamed into place) against a plain loop of
  write + fsync + rename per file of the same size (equal durability), one process per rank.
* warm load: kvcached ``load`` tasks with the objects in the page cache against a plain ``readinto`` of
  each file into its own block of a buffer as large as the blocks (where a load puts its bytes); the
  plain read of every file into one reused buffer (never leaving the CPU's cache) is shown too.
* cold load: the same after the files of each side were dropped from the page cache (fsync, then
  ``posix_fadvise(DONTNEED)`` on each file: only these files, nothing else of the machine's cache).
"""

from __future__ import annotations

import json
import mmap
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchlib
import numpy as np
from bench_lmcache import drop_from_page_cache

import runner_client as rc

ROOT = Path(__file__).resolve().parent.parent
KV_HEADS, HEAD_DIM = 8, 128
#: After READY the worker and its store agent map the device tier's pages in the background (as the plain
#: side maps its buffers before its clock starts): the first task waits that long.
SETTLE_S = 1.0
#: The timed phases of a pass, in order; what each side reports (seconds).
PHASES = ("store", "warm_load", "cold_load")


def plain_file(directory: str, count: int, size: int, barrier: Any, out: Any) -> None:
    """One rank's plain I/O: write+fsync+rename, warm reads (into blocks; into one buffer), cold reads."""
    data = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
    data[:] = np.arange(size, dtype=np.uint64).view(np.uint8)[:size] if size % 8 == 0 else 7
    blocks = np.frombuffer(mmap.mmap(-1, count * size), dtype=np.uint8).reshape(count, size)
    blocks[:] = 1  # mapped before the clock starts, as the daemon's device tier is
    os.makedirs(directory, exist_ok=True)
    paths = [Path(directory) / str(i) for i in range(count)]
    times = []
    barrier.wait()
    started = time.perf_counter()
    for path in paths:
        fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
        os.rename(path.with_suffix(".tmp"), path)
    times.append(time.perf_counter() - started)
    for into in ("blocks", "one buffer", "cold"):
        if into == "cold":
            drop_from_page_cache(paths)
        barrier.wait()
        started = time.perf_counter()
        for i, path in enumerate(paths):
            with open(path, "rb", buffering=0) as f:
                f.readinto(data if into == "one buffer" else blocks[i])
        times.append(time.perf_counter() - started)
    out.put(times)


def plain_pass(work: Path, ranks: int, blocks: int, size: int) -> dict[str, float]:
    """Every rank's plain I/O at once (one process each); the slowest rank's seconds per phase."""
    path = Path(tempfile.mkdtemp(prefix="plain", dir=work))
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(ranks + 1), ctx.Queue()
    procs = [
        ctx.Process(target=plain_file, args=(str(path / f"r{r}"), blocks, size, barrier, out)) for r in range(ranks)
    ]
    try:
        for p in procs:
            p.start()
        for _ in range(4):
            barrier.wait()
        times = [out.get() for _ in procs]
        for p in procs:
            p.join()
    finally:
        shutil.rmtree(path, ignore_errors=True)
    names = ("store", "warm_load", "warm_load_one_buffer", "cold_load")
    return {name: max(t[i] for t in times) for i, name in enumerate(names)}


def kvcached_pass(
    work: Path, env: dict[str, str], ranks: int, blocks: int, layers: int, batch: int, block_bytes: int
) -> dict[str, float]:
    """Store, load, drop the objects from the page cache, load again, through a fresh daemon."""
    block_size = block_bytes // (layers * 2 * KV_HEADS * HEAD_DIM * 2)
    instance = f"bench-store-{os.getpid()}-file"
    path = Path(tempfile.mkdtemp(prefix="kv", dir=work))
    args = benchlib.geometry_args(
        ranks=ranks,
        num_layers=layers,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=block_size,
        num_blocks=2 * blocks,
        num_cpu_blocks=0,
    )
    store = [
        "--storage-backend",
        "file",
        "--storage-path",
        str(path),
        "--storage-capacity",
        str(4 * ranks * blocks * block_bytes),
    ]
    daemon = benchlib.start_daemon(instance, env, [*args, *store])
    time.sleep(SETTLE_S)
    keys = rc.block_keys(list(range(blocks)), 1)
    ids, into = list(range(blocks)), list(range(blocks, 2 * blocks))
    times: dict[str, float] = {}
    try:
        with rc.CacheTasks(instance, timeout=3600) as tasks:
            started = time.perf_counter()
            for h in [
                tasks.submit(tasks.store, None, ids[i : i + batch], keys[i : i + batch])
                for i in range(0, blocks, batch)
            ]:
                h.result()
            times["store"] = time.perf_counter() - started
            for phase in ("warm_load", "cold_load"):
                if phase == "cold_load":
                    drop_from_page_cache(list(path.glob("r*/*/*.kvb")))
                started = time.perf_counter()
                handles = [
                    tasks.submit(tasks.load, None, keys[i : i + batch], into[i : i + batch])
                    for i in range(0, blocks, batch)
                ]
                loaded = sum(h.result().blocks for h in handles)
                times[phase] = time.perf_counter() - started
                assert loaded == blocks, f"loaded {loaded} of {blocks}"
    finally:
        daemon.terminate()
        daemon.wait(60)
        shutil.rmtree(path, ignore_errors=True)
    return times


def lmcache_pass(python: str, work: Path, blocks: int, layers: int, block_bytes: int) -> dict[str, float]:
    """LMCache's local disk backend on the same bytes, in its own interpreter (``bench_lmcache.py``)."""
    path = Path(tempfile.mkdtemp(prefix="lmc", dir=work))
    try:
        done = subprocess.run(
            [
                python,
                str(ROOT / "scripts" / "bench_lmcache.py"),
                "--dir",
                str(path),
                "--blocks",
                str(blocks),
                "--block-bytes",
                str(block_bytes),
                "--layers",
                str(layers),
                "--hidden",
                str(KV_HEADS * HEAD_DIM),
            ],
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
        )
    finally:
        shutil.rmtree(path, ignore_errors=True)
    result = next((line for line in done.stdout.splitlines() if line.startswith("LMCACHE-RESULT ")), None)
    if result is None:
        raise SystemExit(f"bench_lmcache.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    times = json.loads(result.split(" ", 1)[1])
    return {
        "store": times["store_fsync_s"],
        "store_no_fsync": times["store_s"],
        "warm_load": times["warm_load_s"],
        "cold_load": times["cold_load_s"],
    }


def run(args: Any, work: Path, env: dict[str, str]) -> list[dict[str, dict[str, float]]]:
    """``args.repeats`` passes of plain I/O, kvcached (and LMCache), one after the other; seconds per side."""
    block_bytes = args.block_kib << 10
    blocks = int(args.gib * 2**30) // block_bytes
    passes = []
    for _ in range(args.repeats):
        one = {"plain": plain_pass(work, args.ranks, blocks, block_bytes + 128)}
        one["kvcached"] = kvcached_pass(work, env, args.ranks, blocks, args.layers, args.batch, block_bytes)
        if args.lmcache:
            one["lmcache"] = lmcache_pass(args.lmcache, work, blocks, args.layers, block_bytes)
        passes.append(one)
    return passes


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def report(passes: list[dict[str, dict[str, float]]], nbytes: int) -> tuple[list[str], list[dict[str, float]], bool]:
    """The printed table, the JSON rows (GB/s per pass) and whether the targets hold (median ratios >= 0.9
    of plain I/O, >= 1.0 of LMCache)."""
    rows = []
    for one in passes:
        row = {f"{phase}_gbps": gbps(nbytes, one["kvcached"][phase]) for phase in PHASES}
        row |= {f"plain_{phase}_gbps": gbps(nbytes, one["plain"][phase]) for phase in PHASES}
        row["plain_warm_load_one_buffer_gbps"] = gbps(nbytes, one["plain"]["warm_load_one_buffer"])
        for phase, seconds in one.get("lmcache", {}).items():
            row[f"lmcache_{phase}_gbps"] = gbps(nbytes, seconds)
        rows.append(row)
    lines = [
        "file store: GB/s aggregate, median over passes; ratio = kvcached / other side, same pass: median [min-max]",
        "  durability: kvcached and plain fsync every object (or file) before it is renamed into place;",
        "  LMCache writes without fsync ('no fsync'), and 'store' adds an fsync of each of its files;",
        "  plain reads one file at a time per rank, kvcached several objects at once per rank (its reader threads)",
        f"{'phase':<10} {'kvcached':>8} | {'plain':>6} {'ratio':>18} | {'LMCache':>7} {'ratio':>18}",
    ]
    met = True
    for phase in PHASES:
        ours = statistics.median(r[f"{phase}_gbps"] for r in rows)
        cols = [f"{phase.replace('_', ' '):<10} {ours:>8.2f}"]
        for other, target in (("plain", 0.9), ("lmcache", 1.0)):
            if f"{other}_{phase}_gbps" not in rows[0]:
                cols.append(f"{'-':>6} {'':>18}")
                continue
            ratios = sorted(r[f"{phase}_gbps"] / r[f"{other}_{phase}_gbps"] for r in rows)
            met &= statistics.median(ratios) >= target
            theirs = statistics.median(r[f"{other}_{phase}_gbps"] for r in rows)
            cols.append(f"{theirs:>6.2f} {statistics.median(ratios):>6.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]")
        lines.append(" | ".join(cols))
    one_buffer = statistics.median(r["plain_warm_load_one_buffer_gbps"] for r in rows)
    lines.append(f"  plain warm read into one reused buffer (the bytes never leave the CPU's cache): {one_buffer:.2f}")
    if "lmcache_store_no_fsync_gbps" in rows[0]:
        no_fsync = statistics.median(r["lmcache_store_no_fsync_gbps"] for r in rows)
        lines.append(f"  LMCache store without fsync: {no_fsync:.2f}")
    lines.append(f"targets (>= 0.9 of plain I/O, >= 1.0 of LMCache, median): {'met' if met else 'NOT met'}")
    return lines, rows, met


if __name__ == "__main__":
    print(__doc__.strip())
    print("\nNot run on its own: `scripts/bench_store.py --backends file` runs it.")
    sys.exit(0 if set(sys.argv[1:]) <= {"-h", "--help"} else 2)
