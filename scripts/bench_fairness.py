#!/usr/bin/env python3
"""Benchmark how much clients that send large swaps without end cost another client's small task on the same rank.

A daemon of one rank at FastDeploy's TP8 geometry (ERNIE-4.5: 54 layers, 1 KV head, head_dim 128, block 64,
bf16: a block is 1.7 MiB; its own instance ``bench-fair-<pid>``, about 0.9 GiB of /dev/shm) serves
``--heavy`` clients (processes), each sending ``--blocks``-block swap-outs without end (``--in-flight``
submitted at a time: 16 pipelines them; 1 sends each once the last is answered), and one light client
that swaps out one block every ``--every-ms``. The light client's latencies (submit to result) are compared
with the time of one ``--blocks``-block swap measured alone in the same run, before the heavy clients
start, and with the light client's own latencies at the same pace without them (a swap after an idle gap is
slower on a host whose cores idle: what the heavy clients add is the difference).

Target: the light client's p99 at most 2x the time of one large swap (a rank worker runs one connection's
turn at a time, round by round, a connection back from idle joining the round under way ahead of those that
moved more; a turn ends after 4 MiB moved, and is at least one whole task: the light client waits for the
turn under way, not for a turn of each heavy client). The heavy clients, the daemon and the light client
share the host's cores: on 2 cores, with anything else running, the p99 is the scheduler's more than the
daemon's (run it on a quiet host).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402
from helpfmt import show_defaults  # noqa: E402

import runner_client as rc  # noqa: E402

#: ERNIE-4.5 at TP8: layers, KV heads per rank, head_dim, block size (bf16).
TP8 = (54, 1, 128, 64)


def heavy(instance: str, run_dir: str, blocks: int, slots: int, in_flight: int, stop: Any, index: int) -> None:
    """Pipeline ``blocks``-block swap-outs until ``stop`` is set, ``in_flight`` at a time."""
    os.environ["KVCACHED_RUN_DIR"] = run_dir
    with rc.CacheTasks(instance, timeout=600) as tasks:
        pending: list[rc.TaskHandle] = []
        n = index
        while not stop.is_set():
            while len(pending) < in_flight:
                ids = [(n * blocks + i) % slots for i in range(blocks)]
                pending.append(tasks.submit(tasks.swap_out, 0, ids, ids))
                n += 1
            pending.pop(0).result()
        for handle in pending:
            handle.result()


def one_swap_s(tasks: rc.CacheTasks, blocks: int, repeats: int) -> float:
    """Median seconds of one ``blocks``-block swap-out, alone."""
    times = []
    for i in range(repeats):
        ids = [(i * blocks + b) % (4 * blocks) for b in range(blocks)]
        started = time.perf_counter()
        tasks.swap_out(0, ids, ids)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def light(tasks: rc.CacheTasks, slots: int, every_ms: float, seconds: float) -> list[float]:
    """Seconds of each 1-block swap-out, one every ``every_ms``, for ``seconds``; sorted."""
    samples: list[float] = []
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        block = len(samples) % slots
        began = time.perf_counter()
        tasks.swap_out(0, [block], [block])
        samples.append(time.perf_counter() - began)
        time.sleep(max(0.0, every_ms / 1000 - samples[-1]))
    return sorted(samples)


def percentiles(samples: list[float]) -> tuple[float, float]:
    """(p50, p99) of sorted ``samples``."""
    return samples[len(samples) // 2], samples[int(len(samples) * 0.99)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heavy", type=int, default=4, help="clients pipelining large swaps")
    parser.add_argument("--blocks", type=int, default=8, help="blocks per large swap")
    parser.add_argument("--in-flight", type=int, default=16, help="large swaps each heavy client keeps submitted")
    parser.add_argument("--every-ms", type=float, default=100.0, help="the light client's pace")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the light client measures")
    parser.add_argument("--num-blocks", type=int, default=256, help="device and CPU blocks of the rank")
    args = show_defaults(parser).parse_args()

    run_dir = tempfile.mkdtemp(prefix="kvb-")
    os.environ["KVCACHED_RUN_DIR"] = run_dir
    env = {**os.environ}
    instance = f"bench-fair-{os.getpid()}"
    layers, kv_heads, head_dim, block_size = TP8
    geometry = benchlib.geometry_args(
        ranks=1,
        num_layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        num_blocks=args.num_blocks,
        num_cpu_blocks=args.num_blocks,
    )
    daemon = benchlib.start_daemon(instance, env, [*geometry, "--dtype", "bfloat16"])
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    workers: list[Any] = []
    try:
        with rc.CacheTasks(instance, timeout=600) as tasks:
            tasks.swap_out(0, list(range(args.num_blocks)), list(range(args.num_blocks)))  # map every page once
            alone = one_swap_s(tasks, args.blocks, 30)
            quiet = light(tasks, args.num_blocks, args.every_ms, args.seconds / 2)
            workers = [
                ctx.Process(
                    target=heavy, args=(instance, run_dir, args.blocks, args.num_blocks, args.in_flight, stop, i)
                )
                for i in range(args.heavy)
            ]
            for worker in workers:
                worker.start()
            time.sleep(1.0)  # the heavy clients are pipelining
            samples = light(tasks, args.num_blocks, args.every_ms, args.seconds)
    finally:
        stop.set()
        for worker in workers:
            worker.join(60)
        benchlib.stop_daemon(daemon)
        shutil.rmtree(run_dir, ignore_errors=True)
    p50, p99 = percentiles(samples)
    quiet50, quiet99 = percentiles(quiet)
    block_mib = layers * 2 * kv_heads * head_dim * block_size * 2 / 2**20
    print(
        f"fairness: {args.heavy} clients sending {args.blocks}-block swap-outs ({args.blocks * block_mib:.1f} MiB "
        f"each, {args.in_flight} in flight) beside one client swapping out 1 block every {args.every_ms:g} ms; "
        f"TP8 ERNIE-4.5 geometry (a block {block_mib:.2f} MiB), one rank"
    )
    print(f"  one {args.blocks}-block swap alone: {alone * 1e3:.2f} ms (median of 30)")
    print(
        f"  the light client's 1-block swap, {len(samples)} samples: p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms"
        f" = {p99 / alone:.2f}x the large swap alone (target <= 2): {'met' if p99 <= 2 * alone else 'NOT met'}"
    )
    print(
        f"  the same client without the heavy ones ({len(quiet)} samples, same pace, before they start): p50 "
        f"{quiet50 * 1e3:.2f} ms, p99 {quiet99 * 1e3:.2f} ms; what the heavy clients add: "
        f"{(p50 - quiet50) * 1e3:.2f} ms at p50, {(p99 - quiet99) * 1e3:.2f} ms at p99 = "
        f"{(p99 - quiet99) / alone:.2f}x the large swap alone"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
