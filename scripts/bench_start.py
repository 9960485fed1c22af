#!/usr/bin/env python3
"""Benchmark how fast the cache is there: a cold start against the raw allocation of the same bytes, a
start that adopts the memory of a killed daemon, and `kvcached restart` under a stream of swap tasks.

* raw: ``--ranks`` processes at once, each creating a shm object of the rank's bytes (device tier and CPU
  pool), ``posix_fallocate`` and ``mmap(MAP_POPULATE)``: the physical limit of a cold start, same run
  (before the daemon and after it; the better of the two);
* cold: ``kvcached start`` until every rank is READY (a fresh instance), and its ratio to raw;
* adopt: ``kill -9`` of that daemon, then ``kvcached start`` until every rank is READY again (it adopts);
* restart: ``--restarts`` times ``kvcached restart`` while a runner swaps one block out and back in a loop:
  how long each restart took and the longest gap between two completed round trips.

Each rank gets ``--gib`` GiB: three quarters device tier, one quarter CPU pool, in blocks of 4 layers of
16 KiB layer-blocks (a TP8 geometry). Prints a table; ``--json FILE`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402
import posix_ipc  # noqa: E402
from helpfmt import show_defaults  # noqa: E402

import runner_client as rc  # noqa: E402
from kvcached.status import read_status  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 4, 1, 128, 64  # bf16: 16 KiB layer-blocks, 128 KiB blocks
BLOCK_BYTES = LAYERS * 2 * KV_HEADS * HEAD_DIM * BLOCK * 2
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)


def raw_allocate(name: str, nbytes: int, barrier: Any, out: Any) -> None:
    """One rank's share of the limit: create, reserve and populate ``nbytes`` of shm, as the daemon does."""
    barrier.wait()
    started = time.perf_counter()
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
    os.posix_fallocate(shm.fd, 0, nbytes)
    mapping = mmap.mmap(shm.fd, nbytes, flags=mmap.MAP_SHARED | MAP_POPULATE)
    out.put(time.perf_counter() - started)
    mapping.close()
    shm.close_fd()
    shm.unlink()


def raw_seconds(ranks: int, nbytes: int) -> float:
    """Wall time of ``ranks`` processes allocating ``nbytes`` each at once."""
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [
        ctx.Process(target=raw_allocate, args=(f"/kvbench.raw.{os.getpid()}.{r}", nbytes, barrier, out))
        for r in range(ranks)
    ]
    for proc in procs:
        proc.start()
    times = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    return max(times)


def start(instance: str, env: dict[str, str], args: list[str]) -> tuple[subprocess.Popen[bytes], float]:
    """``kvcached start``, and the seconds until every rank was READY (looked at every 5 ms)."""
    started = time.monotonic()
    proc = benchlib.start_daemon(instance, env, args, poll_s=0.005)
    return proc, time.monotonic() - started


def stream(instance: str, stop: Any, results: Any) -> None:
    """A runner process: one-block swap round trips until ``stop`` is set; puts (gaps, ends, errors)."""
    gaps: list[float] = []
    ends: list[float] = []
    errors: list[str] = []
    with rc.CacheTasks(instance, timeout=30) as tasks:
        results.put("started")
        last = time.monotonic()
        while not stop.is_set():
            try:
                tasks.swap_out(None, [1], [2])
                tasks.swap_in(None, [2], [3])
            except rc.KVCacheError as exc:
                errors.append(type(exc).__name__)
            now = time.monotonic()
            gaps.append(now - last)
            ends.append(now)
            last = now
    results.put((gaps, ends, errors))


def restarts(instance: str, env: dict[str, str], count: int) -> dict[str, Any]:
    """``count`` restarts under a stream of one-block swap round trips, from a runner process of its own
    (so that launching the restart commands takes nothing from it)."""
    context = mp.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    runner = context.Process(target=stream, args=(instance, stop, results))
    runner.start()
    began_at: list[float] = []
    took = []
    try:
        if results.get(timeout=60) != "started":
            raise SystemExit("the runner process did not start")
        for _ in range(count):
            time.sleep(0.3)
            began = time.monotonic()
            began_at.append(began)
            result = subprocess.run(
                [sys.executable, "-m", "kvcached.cli", "restart", "--instance", instance],
                env=env,
                capture_output=True,
                text=True,
                cwd=ROOT,
                check=False,
            )
            took.append(time.monotonic() - began)
            if result.returncode != 0:
                raise SystemExit(f"restart failed: {result.stdout}{result.stderr}")
        time.sleep(0.3)
    finally:
        stop.set()
        gaps, ends, errors = results.get(timeout=120)
        runner.join(30)
    longest = sorted(range(len(gaps)), key=gaps.__getitem__)[-2 * count :][::-1]

    def since_restart(i: int) -> float:
        start = ends[i] - gaps[i]
        return start - max((b for b in began_at if b <= start), default=start)

    return {
        "restart_s": took,
        "longest_gap_s": gaps[longest[0]],
        "longest_gaps_s": [gaps[i] for i in longest],
        "longest_gaps_at_s": [since_restart(i) for i in longest],
        "median_round_trip_s": sorted(gaps)[len(gaps) // 2],
        "round_trips": len(gaps),
        "errors": errors,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="ranks of the daemon measured")
    parser.add_argument("--gib", type=float, default=1.0, help="GiB per rank (device tier and CPU pool)")
    parser.add_argument("--restarts", type=int, default=3, help="restarts (and kill -9 + starts) measured")
    parser.add_argument(
        "--dev-shm",
        metavar="OPTIONS",
        help="run in a private /dev/shm mounted with these tmpfs options, e.g. size=20g,huge=within_size",
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = show_defaults(parser).parse_args()
    benchlib.private_dev_shm(args.dev_shm)
    blocks = int(args.gib * 2**30) // BLOCK_BYTES
    device, cpu = blocks * 3 // 4, blocks // 4
    geometry = benchlib.geometry_args(
        ranks=args.ranks,
        num_layers=LAYERS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK,
        num_blocks=device,
        num_cpu_blocks=cpu,
    )
    per_rank = (device + cpu) * BLOCK_BYTES
    instance = f"bench-start-{os.getpid()}"
    run_dir = tempfile.mkdtemp(prefix="kvcached-bench-")  # the daemon's, removed at the end
    env = dict(os.environ, KVCACHED_RUN_DIR=run_dir)
    try:
        raw_before = raw_seconds(args.ranks, per_rank)
        proc, cold = start(instance, env, geometry)
        try:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            proc, adopt = start(instance, env, geometry)
            note = read_status(instance)["note"]
            restarted = restarts(instance, env, args.restarts)
        finally:
            benchlib.stop_daemon(proc)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    raw = min(raw_before, raw_seconds(args.ranks, per_rank))  # before and after: the better raw run
    figures = {
        "ranks": args.ranks,
        "gib": args.gib,
        "bytes_per_rank": per_rank,
        "raw_s": raw,
        "cold_s": cold,
        "cold_over_raw": cold / raw,
        "adopt_s": adopt,
        "adopt_note": note,
        **restarted,
    }
    gib = per_rank / 2**30
    print(f"{args.ranks} ranks x {gib:.2f} GiB (device {device} + CPU {cpu} blocks of {BLOCK_BYTES >> 10} KiB)")
    print(f"  raw allocation (fallocate + MAP_POPULATE, all ranks at once; the better of 2 runs): {raw:.2f} s")
    print(f"  cold start to READY:   {cold:.2f} s  ({cold / raw:.2f} x raw)")
    print(f"  start after kill -9:   {adopt:.2f} s  ({note})")
    spans = ", ".join(f"{s:.2f}" for s in restarted["restart_s"])
    print(f"  kvcached restart:      {spans} s; longest gap between round trips {restarted['longest_gap_s']:.3f} s")
    longest = ", ".join(
        f"{gap * 1000:.0f} (+{at:.2f} s)"
        for gap, at in zip(restarted["longest_gaps_s"], restarted["longest_gaps_at_s"], strict=True)
    )
    print(f"                         longest gaps, ms (+ s since the restart command): {longest}")
    print(f"                         median round trip {restarted['median_round_trip_s'] * 1e6:.0f} us")
    print(f"                         ({restarted['round_trips']} round trips, errors: {restarted['errors'] or 'none'})")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
