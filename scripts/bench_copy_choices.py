#!/usr/bin/env python3
"""The figures behind three choices of the copy paths, each against its alternative in the same run:

* numpy's fallback copies one slice per run of ids (``kvcached.copy_engine``) instead of fancy indexing,
  which gathers into a temporary first (scattered ids: every run one block);
* the host arenas' pages are mapped on a background thread right after READY (``kvcached.memory.shm``
  ``prefault``): the first copy into a fresh shm mapping against one into a mapping already faulted in;
* without the native routine the daemon re-executes itself with glibc tunables that make memcpy stream
  (``kvcached.cli._use_streaming_stores``): piece copies with glibc's defaults against with the tunables,
  each in a fresh interpreter, and what that re-exec costs (one interpreter start-up and import).

Prints GB/s and the ratio of each pair; ``--json FILE`` writes them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import posix_ipc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from helpfmt import show_defaults  # noqa: E402

from kvcached.cli import STREAMING_TUNABLES  # noqa: E402

PIECE_COPY = """
import mmap, sys, time
import numpy as np
piece, count, repeats = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
src = np.frombuffer(mmap.mmap(-1, piece * count), dtype=np.uint8).reshape(count, piece)
dst = np.frombuffer(mmap.mmap(-1, piece * count), dtype=np.uint8).reshape(count, piece)
src[:] = 1
dst[:] = 2
best = 0.0
for _ in range(repeats):
    started = time.perf_counter()
    for i in range(count):
        dst[i] = src[i]
    best = max(best, piece * count / (time.perf_counter() - started) / 1e9)
print(best)
"""


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def runs_against_gather(piece: int, blocks: int, repeats: int) -> dict[str, float]:
    """GB/s of copying ``blocks`` scattered blocks of ``piece`` bytes: one slice per run (every run one
    block) against one fancy-indexed assignment."""
    src = np.frombuffer(mmap.mmap(-1, piece * blocks * 2), dtype=np.uint8).reshape(blocks * 2, piece)
    dst = np.frombuffer(mmap.mmap(-1, piece * blocks * 2), dtype=np.uint8).reshape(blocks * 2, piece)
    src[:] = 3
    rng = np.random.default_rng(0)
    a = rng.permutation(blocks * 2)[:blocks]
    b = rng.permutation(blocks * 2)[:blocks]
    times: dict[str, list[float]] = {"runs": [], "gather": []}
    for _ in range(repeats):
        started = time.perf_counter()
        for x, y in zip(a.tolist(), b.tolist(), strict=True):
            dst[y : y + 1] = src[x : x + 1]
        times["runs"].append(time.perf_counter() - started)
        started = time.perf_counter()
        dst[b] = src[a]
        times["gather"].append(time.perf_counter() - started)
    return {name: gbps(piece * blocks, statistics.median(ts)) for name, ts in times.items()}


def first_touch(size: int) -> dict[str, float]:
    """GB/s of one copy into a fresh shm mapping (one page fault per page) and into one faulted in."""
    name = f"/kvcached-bench-{secrets.token_hex(4)}"
    source = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
    source[:] = 5
    figures = {}
    try:
        for how in ("fresh", "faulted in"):
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size)
            try:
                os.posix_fallocate(shm.fd, 0, size)
                mapping = mmap.mmap(shm.fd, size)
            finally:
                shm.close_fd()
            target = np.frombuffer(mapping, dtype=np.uint8)
            if how == "faulted in":
                target[:: mmap.PAGESIZE] = 0  # one write per page: every page mapped
            started = time.perf_counter()
            target[:] = source
            figures[how] = gbps(size, time.perf_counter() - started)
            del target
            mapping.close()
            posix_ipc.unlink_shared_memory(name)  # the next pass makes it anew
    finally:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)
    return figures


def streaming(piece: int, total: int, repeats: int) -> dict[str, float]:
    """GB/s of piece copies in a fresh interpreter with glibc's defaults and with ``STREAMING_TUNABLES``,
    and seconds of one interpreter start-up that imports the CLI (what the re-exec costs)."""
    tunables = ":".join(f"{name}={value}" for name, value in STREAMING_TUNABLES.items())
    figures = {}
    for how, extra in (("defaults", {}), ("tunables", {"GLIBC_TUNABLES": tunables})):
        env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | extra
        args = [sys.executable, "-c", PIECE_COPY, str(piece), str(total // piece), str(repeats)]
        figures[how] = float(subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout)
    starts = []
    for _ in range(5):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import kvcached.cli"], check=True, cwd=ROOT)
        starts.append(time.perf_counter() - started)
    figures["restart_s"] = statistics.median(starts)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="bytes of the first-touch and streaming copies")
    parser.add_argument("--repeats", type=int, default=5, help="passes of each pair (the median is shown)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = show_defaults(parser).parse_args()
    size = args.mib << 20
    report: dict[str, Any] = {
        "runs_vs_gather_16KiB": runs_against_gather(16 << 10, 4096, args.repeats),
        "first_touch": first_touch(size),
        "streaming_256KiB": streaming(256 << 10, size, args.repeats),
    }
    runs, touch, stream = report["runs_vs_gather_16KiB"], report["first_touch"], report["streaming_256KiB"]
    print(
        f"scattered 16 KiB blocks: one slice per run {runs['runs']:.1f} GB/s, fancy indexing "
        f"{runs['gather']:.1f} GB/s: ratio {runs['runs'] / runs['gather']:.2f}"
    )
    print(
        f"copy of {args.mib} MiB into shm: fresh mapping {touch['fresh']:.1f} GB/s, faulted in "
        f"{touch['faulted in']:.1f} GB/s: ratio {touch['faulted in'] / touch['fresh']:.2f}"
    )
    print(
        f"256 KiB piece copies: glibc defaults {stream['defaults']:.1f} GB/s, streaming tunables "
        f"{stream['tunables']:.1f} GB/s: ratio {stream['tunables'] / stream['defaults']:.2f}; "
        f"the re-exec costs {stream['restart_s']:.2f} s (an interpreter importing the CLI)"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
