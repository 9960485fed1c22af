#!/usr/bin/env python3
"""Benchmark the CPU swap tier against a plain numpy copy of the same bytes, measured in the same run.

For each layer-block size (the bytes of one block of one layer's key cache: 16 KiB to 4 MiB), a daemon is
started with ``--ranks`` ranks of ``--gib`` GiB device cache and as much CPU pool each; every block is
swapped out and back in through ``runner_client.CacheTasks`` with ``rank=None`` (all ranks at once), in
tasks of ``--batch-mib`` MiB. The physical limit beside it: ``--ranks`` processes each doing a plain
``np.copyto`` of ``--gib`` GiB between page-aligned buffers, at the same time. Also: the same swap with
shuffled block ids (no runs to coalesce), and the one-block round trip (submit to completion).

``--geometry NAME`` (repeatable) measures the geometries FastDeploy runs instead of the sweep:

    tp8-ernie     ERNIE-4.5-300B-A47B at TP8: 54 layers, 1 KV head per rank, head_dim 128, block 64, bf16
    tp8-llama70b  a 70B Llama at TP8: 80 layers, 1 KV head, head_dim 128, block 64, bf16
    mla-576       DeepSeek-like MLA: 61 layers, key cache only, [blocks, 1, 64, 576] bf16

All three have small layer-blocks (16 KiB; 72 KiB for MLA): one block is one piece per layer and kind.

Targets: >= 0.7 of the plain copy at 16 KiB layer-blocks with 2 ranks on 2 cores (0.8 with 8
ranks on 16), >= 0.9 at >= 256 KiB, pipelined never below blocking; one-block round trip p50 <= 200 us.
"""

from __future__ import annotations

import argparse
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

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402
from helpfmt import show_defaults  # noqa: E402

import runner_client as rc  # noqa: E402

NUM_LAYERS, KV_HEADS, HEAD_DIM, ITEMSIZE = 4, 8, 128, 2  # bf16; one token of one layer-block: 2 KiB

#: name -> (layers, kv_heads, head_dim, block_size, extra flags)
GEOMETRIES: dict[str, tuple[int, int, int, int, tuple[str, ...]]] = {
    "tp8-ernie": (54, 1, 128, 64, ()),
    "tp8-llama70b": (80, 1, 128, 64, ()),
    "mla-576": (61, 1, 576, 64, ("--mla",)),
}


def plain_copy(nbytes: int, repeats: int, barrier: Any, out: Any) -> None:
    """One process's share of the physical limit: copy ``nbytes`` between aligned buffers, ``repeats``
    times, starting together with the other processes."""
    src = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    dst = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    src[:] = 1
    dst[:] = 2
    times = []
    for _ in range(repeats):
        barrier.wait()
        started = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - started)
    out.put(times)


def plain_copy_gbps(ranks: int, nbytes: int, repeats: int) -> float:
    """Aggregate GB/s of ``ranks`` simultaneous plain copies of ``nbytes`` (median of ``repeats``)."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=plain_copy, args=(nbytes, repeats, barrier, out)) for _ in range(ranks)]
    for p in procs:
        p.start()
    per_proc = [out.get() for _ in procs]
    for p in procs:
        p.join()
    slowest = [max(run) for run in zip(*per_proc, strict=True)]
    return ranks * nbytes / statistics.median(slowest) / 1e9


def start_daemon(
    instance: str, env: dict[str, str], case: tuple[int, int, int, int, tuple[str, ...]], blocks: int, ranks: int
) -> subprocess.Popen[bytes]:
    layers, kv_heads, head_dim, block_size, extra = case
    args = benchlib.geometry_args(
        ranks=ranks,
        num_layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        num_blocks=blocks,
        num_cpu_blocks=blocks,
    )
    return benchlib.start_daemon(instance, env, [*args, "--dtype", "bfloat16", *extra])


def cases(pieces_kib: str, geometries: list[str]) -> list[tuple[str, int, tuple[int, int, int, int, tuple[str, ...]]]]:
    """(label, layer-block KiB, geometry) of each measurement: the named geometries, else the sweep."""
    if geometries:
        found = []
        for name in geometries:
            _, kv_heads, head_dim, block_size, _ = GEOMETRIES[name]
            piece = kv_heads * head_dim * block_size * ITEMSIZE
            found.append((name, piece >> 10, GEOMETRIES[name]))
        return found
    return [
        (f"{kib} KiB", kib, (NUM_LAYERS, KV_HEADS, HEAD_DIM, (kib << 10) // (KV_HEADS * HEAD_DIM * ITEMSIZE), ()))
        for kib in (int(x) for x in pieces_kib.split(","))
    ]


def swap_gbps(
    tasks: rc.CacheTasks, order: np.ndarray[Any, Any], batch: int, total_bytes: int, repeats: int, *, pipelined: bool
) -> tuple[float, float]:
    """Aggregate GB/s of swapping every block out and back in (median of ``repeats``). ``pipelined``
    submits every batch (``CacheTasks.submit``) and then collects the results, so no rank idles while the
    client waits for the slower one; otherwise each batch is waited for before the next is sent."""
    batches = [order[i : i + batch].tolist() for i in range(0, len(order), batch)]
    times: dict[str, list[float]] = {"out": [], "in": []}
    for _ in range(repeats):
        for name, task in (("out", tasks.swap_out), ("in", tasks.swap_in)):
            started = time.perf_counter()
            if pipelined:
                for handle in [tasks.submit(task, None, ids, ids) for ids in batches]:
                    handle.result()
            else:
                for ids in batches:
                    task(None, ids, ids)
            times[name].append(time.perf_counter() - started)
    return tuple(total_bytes / statistics.median(times[name]) / 1e9 for name in ("out", "in"))  # type: ignore[return-value]


def round_trip_us(tasks: rc.CacheTasks, iterations: int, blocks: int) -> tuple[float, float]:
    """p50 and p99 of a one-block swap out on rank 0 (cycling over at most 8 of ``blocks``), submit to
    completion."""
    samples = []
    for i in range(iterations):
        started = time.perf_counter()
        tasks.swap_out(0, [i % min(8, blocks)], [i % min(8, blocks)])
        samples.append(time.perf_counter() - started)
    samples.sort()
    return samples[len(samples) // 2] * 1e6, samples[int(len(samples) * 0.99)] * 1e6


def copy_engine() -> str:
    from kvcached import native

    return native.describe()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="ranks swapping at once")
    parser.add_argument("--gib", type=float, default=1.0, help="device cache (and CPU pool) per rank, GiB")
    parser.add_argument("--pieces-kib", default="16,64,256,1024,4096", help="layer-block sizes to try, KiB")
    parser.add_argument(
        "--geometry", action="append", choices=sorted(GEOMETRIES), default=[], help="a FastDeploy geometry (repeatable)"
    )
    parser.add_argument("--batch-mib", type=int, default=64, help="bytes per task (all layers), MiB")
    parser.add_argument("--repeats", type=int, default=3, help="passes of each measurement (the median is shown)")
    parser.add_argument("--latency-iterations", type=int, default=2000, help="one-block round trips timed")
    parser.add_argument(
        "--dev-shm",
        metavar="OPTIONS",
        help="run in a private /dev/shm mounted with these tmpfs options, e.g. size=20g,huge=within_size",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the raw figures to this file")
    args = show_defaults(parser).parse_args()
    benchlib.private_dev_shm(args.dev_shm)

    run_dir = tempfile.mkdtemp(prefix="kvb-")
    env = {**os.environ, "KVCACHED_RUN_DIR": run_dir}
    os.environ["KVCACHED_RUN_DIR"] = run_dir
    instance = f"bench-swap-{os.getpid()}"
    rows = []
    latency = {}
    first_pass: dict[str, tuple[float, float]] = {}
    try:
        for label, piece_kib, case in cases(args.pieces_kib, args.geometry):
            layers, kinds = case[0], 1 if "--mla" in case[4] else 2
            block_bytes = layers * kinds * (piece_kib << 10)
            blocks = int(args.gib * 2**30) // block_bytes
            daemon = start_daemon(instance, env, case, blocks, args.ranks)
            try:
                total = args.ranks * blocks * block_bytes
                batch = max(1, (args.batch_mib << 20) // block_bytes)
                with rc.CacheTasks(instance, timeout=600) as tasks:
                    tasks.swap_out(None, [0], [0])
                    order = np.arange(blocks)
                    # The first pass after the start also maps the pool's pages (the daemon maps them in the
                    # background after READY): reported apart, not in the steady-state figures.
                    first_out, first_in = swap_gbps(tasks, order, batch, total, 1, pipelined=True)
                    out_gbps, in_gbps = swap_gbps(tasks, order, batch, total, args.repeats, pipelined=True)
                    blk_out, blk_in = swap_gbps(tasks, order, batch, total, args.repeats, pipelined=False)
                    shuffled = np.random.default_rng(0).permutation(blocks)
                    rnd_out, rnd_in = swap_gbps(tasks, shuffled, batch, total, 1, pipelined=True)
                    latency[label] = round_trip_us(tasks, args.latency_iterations if piece_kib == 16 else 300, blocks)
            finally:
                daemon.terminate()
                daemon.wait(60)
            plain = plain_copy_gbps(args.ranks, blocks * block_bytes, args.repeats)
            rows.append((label, piece_kib, block_bytes, out_gbps, in_gbps, blk_out, blk_in, rnd_out, rnd_in, plain))
            first_pass[label] = (first_out, first_in)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)

    print(
        f"swap throughput, {args.ranks} ranks x {args.gib:g} GiB, tasks of {args.batch_mib} MiB sent to all ranks "
        "at once, GB/s aggregate; ratio = swap / plain copy of the same bytes in this run"
    )
    print("  pipelined: every task submitted at once, then collected; blocking: one task at a time;")
    print("  shuffled: block ids in random order (no runs to coalesce), pipelined")
    print(
        f"{'case':>12} {'layer-block':>11} {'block':>9} {'plain':>7} | {'pipelined out':>13} {'in':>6} "
        f"{'ratio':>10} | {'blocking ratio':>14} | {'shuffled ratio':>14} | target"
    )
    met = True
    for label, piece_kib, block_bytes, out_gbps, in_gbps, blk_out, blk_in, rnd_out, rnd_in, plain in rows:
        target = 0.9 if piece_kib >= 256 else 0.7
        met &= min(out_gbps, in_gbps, rnd_out, rnd_in) / plain >= target
        met &= out_gbps >= 0.95 * blk_out and in_gbps >= 0.95 * blk_in  # pipelined never below blocking (noise: 5 %)
        print(
            f"{label:>12} {piece_kib:>7} KiB {block_bytes >> 10:>5} KiB {plain:>7.2f} | {out_gbps:>13.2f} "
            f"{in_gbps:>6.2f} {out_gbps / plain:>4.2f}/{in_gbps / plain:.2f} | {blk_out / plain:>9.2f}/"
            f"{blk_in / plain:.2f} | {rnd_out / plain:>9.2f}/{rnd_in / plain:.2f} | {target:.1f}"
        )
    print("first pass after the start (the pool's pages mapped as they are first touched), GB/s out / in:")
    print("  " + "; ".join(f"{label} {o:.2f} / {i:.2f}" for label, (o, i) in first_pass.items()))
    print("one-block round trip (swap out of 1 block on rank 0, submit to completion), microseconds:")
    for (label, (p50, p99)), row in zip(latency.items(), rows, strict=True):
        print(f"  {label:>12} (block {row[2] >> 10:>6} KiB): p50 {p50:7.0f}  p99 {p99:7.0f}")
    if not args.geometry:  # the round-trip target is for the sweep's smallest block (128 KiB)
        met &= next(iter(latency.values()))[0] <= 200
    print(
        "targets (>= 0.9 / 0.7 of plain copy at >= 256 / smaller layer-blocks, shuffled too; pipelined >= blocking"
        f"{'' if args.geometry else '; one-block p50 <= 200 us'}): {'met' if met else 'NOT met'}"
    )
    print(f"copy engine: {copy_engine()}")
    if args.json is not None:
        keys = ("case", "piece_kib", "block_bytes", "out_gbps", "in_gbps", "blocking_out_gbps", "blocking_in_gbps")
        keys += ("shuffled_out_gbps", "shuffled_in_gbps", "plain_gbps")
        figures = {
            "ranks": args.ranks,
            "gib": args.gib,
            "rows": [dict(zip(keys, row, strict=True)) for row in rows],
            "round_trip_us": {str(k): {"p50": v[0], "p99": v[1]} for k, v in latency.items()},
            "first_pass_gbps": {k: {"out": v[0], "in": v[1]} for k, v in first_pass.items()},
            "copy_engine": copy_engine(),
            "targets_met": met,
        }
        args.json.write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
