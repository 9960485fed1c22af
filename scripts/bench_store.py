#!/usr/bin/env python3
"""Benchmark the attention store against plain I/O of the same objects, measured in the same run.

For ``--ranks`` ranks of ``--gib`` GiB each (blocks of ``--block-kib`` KiB), every block is stored with
``CacheTasks.store(None, ...)`` and loaded back with ``CacheTasks.load(None, ...)``, in pipelined tasks of
``--batch`` blocks. Beside it, with one process per rank running at the same time:

* file: plain ``write`` + ``fsync`` of one file per block (same sizes, same directory's file system), then
  plain ``readinto`` of them. Reads of both are from disk when the page cache can be dropped (root),
  else from the page cache; the report says which.
* mooncake: plain ``put`` / ``get_into`` of the same objects with a Mooncake client per process, against a
  fresh ``mooncake_master`` on loopback (the baseline of the target); and, for information, the same with
  the batch calls and placement kvcached itself uses (``batch_put_from`` / ``batch_get_into``, 32 objects
  a call, each client's own segment preferred).

Passes alternate (plain, kvcached, plain, ...), each on fresh state (a new directory, a new master and
daemon), and the report gives the median ratio of each pair with its range: on this shared machine the
disk and memory speed drift between sequential measurements by 20 % and more.

Targets (issue 4): >= 0.7 of plain file I/O, >= 0.8 of plain Mooncake.
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

import bench_mooncake_hosts  # noqa: E402
import benchlib  # noqa: E402

import runner_client as rc  # noqa: E402

KV_HEADS, HEAD_DIM, NUM_LAYERS = 8, 128, 4


def drop_caches() -> bool:
    """Drop the page cache (root only); True if it was dropped."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def mooncake_master(log: Path) -> Any:
    port, http = free_port(), free_port()
    binary = shutil.which("mooncake_master", path=str(Path(sys.executable).parent)) or shutil.which("mooncake_master")
    if binary is None:
        raise SystemExit("mooncake_master not found: pip install '.[mooncake]'")
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
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
    try:
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


def plain_file(directory: str, count: int, size: int, barrier: Any, out: Any) -> None:
    data = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
    data[:] = np.arange(size, dtype=np.uint64).view(np.uint8)[:size] if size % 8 == 0 else 7
    os.makedirs(directory, exist_ok=True)
    barrier.wait()
    started = time.perf_counter()
    for i in range(count):
        fd = os.open(f"{directory}/{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.write(fd, data)
        os.fsync(fd)
        os.close(fd)
    write_s = time.perf_counter() - started
    barrier.wait()  # the parent drops the page cache here
    barrier.wait()
    started = time.perf_counter()
    for i in range(count):
        with open(f"{directory}/{i}", "rb", buffering=0) as f:
            f.readinto(data)
    out.put((write_s, time.perf_counter() - started))


def segment_bytes(count: int, size: int) -> int:
    """Memory each Mooncake client (daemon rank or plain client alike) contributes: twice the volume it
    stores, plus slack. With only the volume itself, the daemon's stores slowed to a third of the plain
    puts' speed as the pool filled (seen at 1 GiB per rank, not at 0.5 GiB)."""
    return 2 * count * (size + 4096) + (256 << 20)


def plain_mooncake(
    master: str, metadata: str, rank: int, count: int, size: int, batched: bool, barrier: Any, out: Any
) -> None:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    batch = 32 if batched else 1
    client = MooncakeDistributedStore()
    assert client.setup("127.0.0.1", metadata, segment_bytes(count, size), 64 << 20, "tcp", "", master) == 0
    own = ReplicateConfig()
    own.preferred_segment = client.get_hostname()
    data = np.frombuffer(mmap.mmap(-1, size * batch), dtype=np.uint8)
    data[:] = 3
    client.register_buffer(data.ctypes.data, data.nbytes)
    names = [f"plain/{rank}/{i}" for i in range(count)]
    ptrs = [data.ctypes.data + j * size for j in range(batch)]
    barrier.wait()
    started = time.perf_counter()
    for i in range(0, count, batch):
        if batched:
            chunk = names[i : i + batch]
            assert client.batch_put_from(chunk, ptrs[: len(chunk)], [size] * len(chunk), own) == [0] * len(chunk)
        else:
            assert client.put(names[i], data) == 0
    put_s = time.perf_counter() - started
    barrier.wait()
    barrier.wait()
    started = time.perf_counter()
    for i in range(0, count, batch):
        if batched:
            chunk = names[i : i + batch]
            assert client.batch_get_into(chunk, ptrs[: len(chunk)], [size] * len(chunk)) == [size] * len(chunk)
        else:
            assert client.get_into(names[i], data.ctypes.data, size) == size
    out.put((put_s, time.perf_counter() - started))
    barrier.wait()  # keep the segment mounted until every process has read
    client.close()


def plain_mc(work: Path, ranks: int, blocks: int, block_bytes: int, batched: bool) -> tuple[float, float]:
    """One pass of the plain Mooncake baseline against its own fresh master: single put/get calls, or the
    batch calls kvcached itself uses (32 objects a call)."""
    with mooncake_master(work / "master.log") as (master, metadata):
        return run_plain(
            plain_mooncake, [(master, metadata, r, blocks, block_bytes + 128, batched) for r in range(ranks)], False
        )


def run_plain(target: Any, args_per_rank: list[tuple[Any, ...]], drop: bool) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    ranks = len(args_per_rank)
    barrier, out = ctx.Barrier(ranks + 1), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*a, barrier, out)) for a in args_per_rank]
    for p in procs:
        p.start()
    barrier.wait()
    barrier.wait()
    if drop:
        drop_caches()
    barrier.wait()
    times = [out.get() for _ in procs]
    if target is plain_mooncake:
        barrier.wait()
    for p in procs:
        p.join()
    return max(t[0] for t in times), max(t[1] for t in times)


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
    return benchlib.start_daemon(instance, env, [*args, *store])


def run_kvcached(instance: str, blocks: int, batch: int, drop: bool) -> tuple[float, float]:
    keys = rc.block_keys(list(range(blocks)), 1)
    ids = list(range(blocks))
    with rc.CacheTasks(instance, timeout=3600) as tasks:
        started = time.perf_counter()
        handles = [
            tasks.store(None, ids[i : i + batch], keys[i : i + batch], wait=False) for i in range(0, blocks, batch)
        ]
        for h in handles:
            h.result()
        store_s = time.perf_counter() - started
        if drop:
            drop_caches()
        started = time.perf_counter()
        handles = [
            tasks.load(None, keys[i : i + batch], ids[i : i + batch], wait=False) for i in range(0, blocks, batch)
        ]
        loaded = sum(h.result().blocks for h in handles)
        load_s = time.perf_counter() - started
        assert loaded == blocks, f"loaded {loaded} of {blocks}"
    return store_s, load_s


def kvcached_pass(
    backend: str, work: Path, env: dict[str, str], args: Any, blocks: int, block_bytes: int, drop: bool
) -> tuple[float, float]:
    """Store and load every block through a fresh daemon (and, for mooncake, a fresh master)."""
    block_size = block_bytes // (NUM_LAYERS * 2 * KV_HEADS * HEAD_DIM * 2)
    instance = f"bench-store-{os.getpid()}-{backend}"
    with contextlib.ExitStack() as stack:
        if backend == "file":
            path = Path(tempfile.mkdtemp(prefix="kv", dir=work))
            store = [
                "--storage-backend",
                "file",
                "--storage-path",
                str(path),
                "--storage-capacity",
                str(4 * args.ranks * blocks * block_bytes),
            ]
            stack.callback(shutil.rmtree, path, ignore_errors=True)
        else:
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
            return run_kvcached(instance, blocks, args.batch, drop and backend == "file")
        finally:
            daemon.terminate()
            daemon.wait(60)


def plain_pass(backend: str, work: Path, ranks: int, blocks: int, block_bytes: int, drop: bool) -> tuple[float, float]:
    """The same objects written and read plainly, one process per rank at once."""
    if backend == "file":
        path = Path(tempfile.mkdtemp(prefix="plain", dir=work))
        try:
            return run_plain(plain_file, [(str(path / f"r{r}"), blocks, block_bytes + 128) for r in range(ranks)], drop)
        finally:
            shutil.rmtree(path, ignore_errors=True)
    return plain_mc(work, ranks, blocks, block_bytes, batched=backend == "mooncake-batch")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--gib", type=float, default=1.0, help="bytes stored per rank, GiB")
    parser.add_argument("--block-kib", type=int, default=512, help="bytes of one block (all layers), KiB")
    parser.add_argument("--batch", type=int, default=64, help="blocks per task")
    parser.add_argument("--repeats", type=int, default=3, help="alternating plain / kvcached passes per backend")
    parser.add_argument(
        "--dir", default=None, help="directory for the file backend (default: a temp dir under /var/tmp)"
    )
    parser.add_argument("--backends", default="file,mooncake")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw figures to this file")
    args = parser.parse_args()

    block_bytes = args.block_kib << 10
    blocks = int(args.gib * 2**30) // block_bytes
    total = args.ranks * blocks * block_bytes
    work = Path(tempfile.mkdtemp(prefix="kvbs-", dir=args.dir or "/var/tmp"))
    run_dir = tempfile.mkdtemp(prefix="kvb-")
    env = {**os.environ, "KVCACHED_RUN_DIR": run_dir}
    os.environ["KVCACHED_RUN_DIR"] = run_dir
    drop = drop_caches()
    results: dict[str, list[tuple[tuple[float, float], tuple[float, float]]]] = {}
    hosts: dict[str, Any] | None = None
    try:
        for backend in args.backends.split(","):
            for _ in range(args.repeats):
                plain = plain_pass(backend, work, args.ranks, blocks, block_bytes, drop)
                batched = (
                    plain_pass("mooncake-batch", work, args.ranks, blocks, block_bytes, drop)
                    if (backend == "mooncake")
                    else None
                )
                ours = kvcached_pass(backend, work, env, args, blocks, block_bytes, drop)
                results.setdefault(backend, []).append((ours, plain))
                if batched is not None:
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
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)

    print(
        f"attention store, {args.ranks} ranks x {args.gib:g} GiB in blocks of {args.block_kib} KiB, tasks of "
        f"{args.batch} blocks to all ranks; {args.repeats} alternating passes of plain I/O and kvcached"
    )
    print(f"file reads: {'from disk (page cache dropped)' if drop else 'from the page cache (cannot drop it)'}")
    print("GB/s aggregate, median over passes; ratio = kvcached / plain of the same pass pair: median [min-max]")
    print(
        f"{'backend':<9} {'plain':<19} {'plain st':>9} {'store':>7} {'ratio':>18} | {'plain ld':>9} {'load':>7} "
        f"{'ratio':>18} | target"
    )
    met = True
    names = {"file": "write+fsync / read", "mooncake": "put / get", "mooncake-batch": "own-seg batch p/g"}
    for backend, passes in results.items():
        target = {"file": 0.7, "mooncake": 0.8}.get(backend)  # the batch row is for information
        cols = []
        for i in (0, 1):
            plain_gbps = statistics.median(total / p[i] / 1e9 for _, p in passes)
            ours_gbps = statistics.median(total / o[i] / 1e9 for o, _ in passes)
            ratios = sorted(p[i] / o[i] for o, p in passes)
            if target is not None:
                met &= statistics.median(ratios) >= target
            cols.append(
                f"{plain_gbps:>9.2f} {ours_gbps:>7.2f} {statistics.median(ratios):>6.2f} "
                f"[{ratios[0]:.2f}-{ratios[-1]:.2f}]"
            )
        label = "mooncake" if backend.startswith("mooncake") else backend
        print(f"{label:<9} {names[backend]:<19} {cols[0]} | {cols[1]} | {target or '-'}")
    print(f"targets (median ratio): {'met' if met else 'NOT met'}")
    if hosts is not None:
        print("\n".join(bench_mooncake_hosts.report(hosts)))
    if args.json is not None:
        figures: dict[str, Any] = {"ranks": args.ranks, "gib": args.gib, "block_kib": args.block_kib, "backends": {}}
        for backend, passes in results.items():
            figures["backends"][backend] = [
                {"store_gbps": total / o[0] / 1e9, "load_gbps": total / o[1] / 1e9,
                 "plain_store_gbps": total / p[0] / 1e9, "plain_load_gbps": total / p[1] / 1e9}
                for o, p in passes
            ]  # fmt: skip
        figures["targets_met"] = met
        figures["mooncake_hosts"] = hosts
        args.json.write_text(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
