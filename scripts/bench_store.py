#!/usr/bin/env python3
"""Benchmark the attention store against plain I/O of the same objects, measured in the same run.

For ``--ranks`` ranks of ``--gib`` GiB each (blocks of ``--block-kib`` KiB), every block is stored with
``CacheTasks.store(None, ...)`` and loaded back with ``CacheTasks.load(None, ...)``, in pipelined tasks of
``--batch`` blocks. Beside it, with one process per rank running at the same time:

* file (``bench_filestore.py``): store, warm load and cold load (the objects dropped from the page cache)
  beside plain write + fsync + rename and plain ``readinto`` of one file per block (same sizes, same
  directory's file system), and with ``--lmcache PYTHON`` LMCache's local disk backend on the same bytes.
* mooncake: plain ``put`` / ``get_into`` of the same objects with a Mooncake client per process, against a
  fresh ``mooncake_master`` on loopback; and the batch calls and placement kvcached itself uses
  (``batch_put_from`` / ``batch_get_into``, 32 objects a call, each client's own segment preferred), the
  get landing each object in its own place (and, for information, into one reused buffer); then two hosts
  (``bench_mooncake_hosts.py``).

Passes alternate (plain, kvcached, plain, ...), each on fresh state: a new directory, or a new master that
no pass used before (launched while the pass before ran), and for kvcached a new daemon. The report gives
the median ratio of each pair with its range: on this shared machine the disk and memory speed drift
between sequential measurements by 20 % and more.

Targets: >= 0.9 of plain file I/O and >= 1.0 of LMCache (file); >= 0.8 of plain Mooncake put / get, loads
>= 0.9 of the batched get (each object into its own place, as a load lands it), and the cross-host load
>= 0.9 of the plain batched get of the same objects.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import multiprocessing as mp
import os
import shutil
import socket
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

import bench_filestore  # noqa: E402
import bench_mooncake_hosts  # noqa: E402
import benchlib  # noqa: E402
from helpfmt import show_defaults  # noqa: E402

import runner_client as rc  # noqa: E402

KV_HEADS, HEAD_DIM, NUM_LAYERS = 8, 128, 4
#: Per backend, per pass: (kvcached's store and load seconds, the plain side's seconds: store, load[, load
#: into one reused buffer]).
Results = dict[str, list[tuple[tuple[float, ...], tuple[float, ...]]]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The next pass's master, launched when a pass takes its own (a master takes over a second to listen).
_next: list[tuple[subprocess.Popen[bytes], int, int, Path]] = []


def _launch(log: Path) -> tuple[subprocess.Popen[bytes], int, int, Path]:
    """A master, not waited for, killed if this benchmark dies; it writes its own log, beside ``log``."""
    port, http = free_port(), free_port()
    binary = shutil.which("mooncake_master", path=str(Path(sys.executable).parent)) or shutil.which("mooncake_master")
    if binary is None:
        raise SystemExit("mooncake_master not found: pip install '.[mooncake]'")
    log = log.with_name(f"{log.stem}-{port}{log.suffix}")
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                *benchlib.die_with_us("KILL"),
                binary,
                f"--port={port}",
                f"--metrics_port={free_port()}",  # its default, 9003, would collide with another run's master
                "--enable_http_metadata_server=true",
                f"--http_metadata_server_port={http}",
                "--http_metadata_server_host=127.0.0.1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return proc, port, http, log


def stop_next_master() -> None:
    """Kill the master launched for a pass that did not come."""
    while _next:
        proc = _next.pop()[0]
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def mooncake_master(log: Path) -> Any:
    """A fresh master (no pass used it before) that listens, for one pass; the next pass's is launched now."""
    proc, port, http, log = _next.pop() if _next else _launch(log)
    try:
        _next.append(_launch(log))
        for p in (port, http):
            deadline = time.monotonic() + 30
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", p), timeout=0.2):
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"mooncake_master did not start: {log.read_text(errors='replace')[-2000:]}")
                time.sleep(0.05)
        yield f"127.0.0.1:{port}", f"http://127.0.0.1:{http}/metadata"
    finally:
        proc.kill()
        proc.wait()


# -- the plain baselines, one process per rank ------------------------------------------------------------


def segment_bytes(count: int, size: int) -> int:
    """Memory each Mooncake client (daemon rank or plain client alike) contributes: twice the volume it
    stores, plus slack. With only the volume itself, the daemon's stores slowed to a third of the plain
    puts' speed as the pool filled (seen at 1 GiB per rank, not at 0.5 GiB)."""
    return 2 * count * (size + 4096) + (256 << 20)


def plain_mooncake(
    master: str, metadata: str, rank: int, count: int, size: int, batched: bool, barrier: Any, out: Any
) -> None:
    """One rank's plain client: single put/get calls, or the batch calls kvcached makes. A batched get lands
    each object in its own place of a buffer as large as the objects (as a load lands each block in its
    own device block); it is also timed into one reused buffer of a batch's size, which stays in the CPU's
    cache (for information)."""
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    batch = 32 if batched else 1
    places = count if batched else 1
    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", metadata, segment_bytes(count, size), 64 << 20, "tcp", "", master) == 0
    own = ReplicateConfig()
    own.preferred_segment = client.get_hostname()
    data = np.frombuffer(mmap.mmap(-1, size * places), dtype=np.uint8)
    data[:] = 3
    client.register_buffer(data.ctypes.data, data.nbytes)
    names = [f"plain/{rank}/{i}" for i in range(count)]
    ptrs = [data.ctypes.data + j * size for j in range(places)]
    barrier.wait()
    started = time.perf_counter()
    for i in range(0, count, batch):
        if batched:
            chunk = names[i : i + batch]
            assert client.batch_put_from(chunk, ptrs[i : i + batch], [size] * len(chunk), own) == [0] * len(chunk)
        else:
            assert client.put(names[i], data) == 0
    put_s = time.perf_counter() - started
    barrier.wait()
    barrier.wait()
    times = [put_s]
    for reused in (False, True) if batched else (False,):
        started = time.perf_counter()
        for i in range(0, count, batch):
            if batched:
                chunk, into = names[i : i + batch], ptrs[: len(names[i : i + batch])] if reused else ptrs[i : i + batch]
                assert client.batch_get_into(chunk, into, [size] * len(chunk)) == [size] * len(chunk)
            else:
                assert client.get_into(names[i], data.ctypes.data, size) == size
        times.append(time.perf_counter() - started)
    out.put(tuple(times))
    barrier.wait()  # keep the segment mounted until every process has read
    client.close()


def plain_mc(work: Path, ranks: int, blocks: int, block_bytes: int, batched: bool) -> tuple[float, ...]:
    """One pass of the plain Mooncake baseline against its own fresh master: single put/get calls, or the
    batch calls kvcached itself uses (32 objects a call)."""
    with mooncake_master(work / "master.log") as (master, metadata):
        return run_plain(
            plain_mooncake, [(master, metadata, r, blocks, block_bytes + 128, batched) for r in range(ranks)]
        )


def run_plain(target: Any, args_per_rank: list[tuple[Any, ...]]) -> tuple[float, ...]:
    ctx = mp.get_context("spawn")
    ranks = len(args_per_rank)
    barrier, out = ctx.Barrier(ranks + 1), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, barrier, out)) for a in args_per_rank]
    for p in procs:
        p.start()
    barrier.wait()
    barrier.wait()
    barrier.wait()
    times = [out.get() for _ in procs]
    if target is plain_mooncake:
        barrier.wait()
    for p in procs:
        p.join()
    return tuple(max(t[k] for t in times) for k in range(len(times[0])))


# -- kvcached ---------------------------------------------------------------------------------------------


def start_daemon(
    instance: str, env: dict[str, str], ranks: int, blocks: int, block_size: int, store: list[str]
) -> subprocess.Popen[bytes]:
    args = benchlib.geometry_args(
        ranks=ranks,
        num_layers=NUM_LAYERS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=block_size,
        num_blocks=blocks,
        num_cpu_blocks=0,
    )
    daemon = benchlib.start_daemon(instance, env, [*args, *store])
    try:
        benchlib.wait_store(instance)
    except BaseException:
        benchlib.stop_daemon(daemon)
        raise
    return daemon


def run_kvcached(instance: str, blocks: int, batch: int) -> tuple[float, float]:
    keys = rc.block_keys(list(range(blocks)), 1)
    ids = list(range(blocks))
    with rc.CacheTasks(instance, timeout=3600) as tasks:
        started = time.perf_counter()
        handles = [
            tasks.submit(tasks.store, None, ids[i : i + batch], keys[i : i + batch]) for i in range(0, blocks, batch)
        ]
        for h in handles:
            h.result()
        store_s = time.perf_counter() - started
        started = time.perf_counter()
        handles = [
            tasks.submit(tasks.load, None, keys[i : i + batch], ids[i : i + batch]) for i in range(0, blocks, batch)
        ]
        loaded = sum(h.result().blocks for h in handles)
        load_s = time.perf_counter() - started
        assert loaded == blocks, f"loaded {loaded} of {blocks}"
    return store_s, load_s


def kvcached_pass(
    backend: str, work: Path, env: dict[str, str], args: Any, blocks: int, block_bytes: int
) -> tuple[float, float]:
    """Store and load every block through a fresh daemon and a fresh master."""
    block_size = block_bytes // (NUM_LAYERS * 2 * KV_HEADS * HEAD_DIM * 2)
    instance = f"bench-store-{os.getpid()}-{backend}"
    with contextlib.ExitStack() as stack:
        master, metadata = stack.enter_context(mooncake_master(work / "master.log"))
        store = [
            "--storage-backend",
            "mooncake",
            "--mooncake-master",
            master,
            "--mooncake-metadata",
            metadata,
            "--mooncake-segment",
            str(segment_bytes(blocks, block_bytes + 128)),
        ]
        daemon = start_daemon(instance, env, args.ranks, blocks, block_size, store)
        try:
            return run_kvcached(instance, blocks, args.batch)
        finally:
            daemon.terminate()
            daemon.wait(60)


def plain_pass(backend: str, work: Path, ranks: int, blocks: int, block_bytes: int) -> tuple[float, ...]:
    """The same objects put and got plainly, one process per rank at once."""
    return plain_mc(work, ranks, blocks, block_bytes, batched=backend == "mooncake-batch")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2, help="ranks storing and loading at once")
    parser.add_argument("--gib", type=float, default=1.0, help="bytes stored per rank, GiB")
    parser.add_argument("--block-kib", type=int, default=512, help="bytes of one block (all layers), KiB")
    parser.add_argument(
        "--layers",
        type=int,
        default=NUM_LAYERS,
        help="layers of the file backend's geometry: an object is LAYERS x K,V pieces of BLOCK_KIB / (2 x LAYERS) "
        f"KiB, each a whole number of tokens of {KV_HEADS} heads x {HEAD_DIM} x bf16",
    )
    parser.add_argument("--batch", type=int, default=64, help="blocks per task")
    parser.add_argument("--repeats", type=int, default=3, help="alternating plain / kvcached passes per backend")
    parser.add_argument(
        "--dir", default=None, help="directory for the file backend (default: a temp dir under /var/tmp)"
    )
    parser.add_argument(
        "--backends",
        default="file,mooncake",
        help="comma-separated: file, mooncake (needs the mooncake extra and Debian's libibverbs1 libnuma1)",
    )
    parser.add_argument(
        "--lmcache", metavar="PYTHON", default=None, help="an interpreter with LMCache (see bench_lmcache.py)"
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the raw figures to this file")
    args = show_defaults(parser).parse_args()

    block_bytes = args.block_kib << 10
    token = args.layers * 2 * KV_HEADS * HEAD_DIM * 2  # one token of every layer's key and value
    if "file" in args.backends and (args.layers < 1 or block_bytes % token):
        parser.error(
            f"--block-kib {args.block_kib} is not a whole number of tokens of --layers {args.layers} (a token of "
            f"every layer's key and value: {token} bytes): try --block-kib {max(1, block_bytes // token) * token >> 10}"
        )
    blocks = int(args.gib * 2**30) // block_bytes
    total = args.ranks * blocks * block_bytes
    work = Path(tempfile.mkdtemp(prefix="kvbs-", dir=args.dir or "/var/tmp"))
    run_dir = tempfile.mkdtemp(prefix="kvb-")
    env = {**os.environ, "KVCACHED_RUN_DIR": run_dir}
    os.environ["KVCACHED_RUN_DIR"] = run_dir
    results: Results = {}
    file_passes: list[dict[str, dict[str, float]]] = []
    hosts: dict[str, Any] | None = None
    try:
        for backend in args.backends.split(","):
            if backend == "file":
                file_passes = bench_filestore.run(args, work, env)
                continue
            for _ in range(args.repeats):
                plain = plain_pass(backend, work, args.ranks, blocks, block_bytes)
                batched = plain_pass("mooncake-batch", work, args.ranks, blocks, block_bytes)
                ours = kvcached_pass(backend, work, env, args, blocks, block_bytes)
                results.setdefault(backend, []).append((ours, plain))
                results.setdefault("mooncake-batch", []).append((ours, batched))
            if backend == "mooncake":
                hosts = bench_mooncake_hosts.cross_host(
                    work,
                    env,
                    args,
                    blocks,
                    block_bytes,
                    block_bytes // (NUM_LAYERS * 2 * KV_HEADS * HEAD_DIM * 2),
                    master=mooncake_master,
                    daemon=start_daemon,
                    segment=segment_bytes(blocks, block_bytes + 128),
                )
    finally:
        stop_next_master()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)

    print(
        f"attention store, {args.ranks} rank(s) x {args.gib:g} GiB: {blocks} blocks of {args.block_kib} KiB (the file "
        f"store's: {args.layers} layers x K,V pieces of {args.block_kib / (2 * args.layers):g} KiB), tasks of "
        f"{args.batch} blocks to all ranks; {args.repeats} alternating passes of plain I/O and kvcached"
    )
    met = True
    figures: dict[str, Any] = {"ranks": args.ranks, "gib": args.gib, "block_kib": args.block_kib, "backends": {}}
    if file_passes:
        lines, figures["backends"]["file"], met = bench_filestore.report(file_passes, total)
        print("\n".join(lines))
    if results:
        met &= mooncake_report(results, total)
        figures["backends"] |= mooncake_figures(results, total)
    if hosts is not None:
        print("\n".join(bench_mooncake_hosts.report(hosts)))
        met &= bench_mooncake_hosts.met(hosts)
    print(f"targets (median ratio, every row above): {'met' if met else 'NOT met'}")
    if args.json is not None:
        figures["targets_met"] = met
        figures["mooncake_hosts"] = hosts
        args.json.write_text(json.dumps(figures))
    return 0


def mooncake_figures(results: Results, total: int) -> dict[str, list[dict[str, float]]]:
    """The Mooncake rows of the JSON figures: GB/s per pass."""
    rows: dict[str, list[dict[str, float]]] = {}
    for backend, passes in results.items():
        for o, p in passes:
            row = {"store_gbps": total / o[0] / 1e9, "load_gbps": total / o[1] / 1e9}
            row |= {"plain_store_gbps": total / p[0] / 1e9, "plain_load_gbps": total / p[1] / 1e9}
            if len(p) > 2:
                row["plain_load_reused_gbps"] = total / p[2] / 1e9
            rows.setdefault(backend, []).append(row)
    return rows


#: Median ratios to reach, per row (store, load): >= 0.8 of single calls, loads >= 0.9 of the batched get.
MOONCAKE_TARGETS = {"mooncake": (0.8, 0.8), "mooncake-batch": (None, 0.9)}


def mooncake_report(results: Results, total: int) -> bool:
    """Print the Mooncake rows; whether their targets hold."""
    print("mooncake: GB/s aggregate, median over passes; ratio = kvcached / plain of the same pass pair")
    print(
        f"{'backend':<9} {'plain':<19} {'plain st':>9} {'store':>7} {'ratio':>18} | {'plain ld':>9} {'load':>7} "
        f"{'ratio':>18} | target"
    )
    met = True
    names = {"mooncake": "put / get", "mooncake-batch": "own-seg batch p/g"}
    for backend, passes in results.items():
        targets = MOONCAKE_TARGETS[backend]
        cols = []
        for i in (0, 1):
            plain_gbps = statistics.median(total / p[i] / 1e9 for _, p in passes)
            ours_gbps = statistics.median(total / o[i] / 1e9 for o, _ in passes)
            ratios = sorted(p[i] / o[i] for o, p in passes)
            target = targets[i]
            if target is not None:
                met &= statistics.median(ratios) >= target
            cols.append(
                f"{plain_gbps:>9.2f} {ours_gbps:>7.2f} {statistics.median(ratios):>6.2f} "
                f"[{ratios[0]:.2f}-{ratios[-1]:.2f}]"
            )
        wanted = " / ".join("-" if t is None else f"{t:g}" for t in targets)
        print(f"{'mooncake':<9} {names[backend]:<19} {cols[0]} | {cols[1]} | {wanted}")
        reused = sorted(p[2] / o[1] for o, p in passes if len(p) > 2)
        if reused:
            print(
                f"  the batched get lands each object in its own place; into one reused buffer of a batch's size "
                f"(it stays in the CPU's cache): {statistics.median(total / p[2] / 1e9 for _, p in passes):.2f} "
                f"GB/s, kvcached's load {statistics.median(reused):.2f} [{reused[0]:.2f}-{reused[-1]:.2f}] of it"
            )
    return met


if __name__ == "__main__":
    sys.exit(main())
