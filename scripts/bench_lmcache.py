#!/usr/bin/env python3
"""LMCache's local disk backend on the bytes ``bench_store.py`` gives kvcached's file store, for comparison.

Runs in an interpreter that has LMCache (its pins conflict with the project's: numpy <= 2.2.6, protobuf < 7,
prometheus_client <= 0.24.1, so it gets a venv of its own, with a CPU build of torch)::

    python3 -m venv .venv-lmcache && .venv-lmcache/bin/pip install torch lmcache==0.5.6   # torch: a CPU build

``bench_store.py --lmcache .venv-lmcache/bin/python`` runs it once per pass and reads the JSON it prints.
It imports nothing of kvcached.

LMCache has no CPU entry point, so this drives its own engine (``LMCacheEngine``, built by
``LMCacheEngineBuilder`` as its standalone mode does) with its local disk backend only (``local_cpu``
off, so loads come from the disk backend, not from its CPU cache) and one chunk per block, so that each
chunk is one file of the same size as a kvcached object. The engine copies each chunk between a KV cache
in host memory and its buffers through a connector that this script supplies (its own connectors need
a GPU): a plain ``torch`` copy of the chunk's layer slices, the work kvcached's native copy does.

What is timed, one chunk per block, ``--blocks`` blocks of ``--block-bytes`` each:

* store: ``engine.store`` until every chunk's file is written (LMCache writes files without fsync: what
  it stores survives a crash of the process, not of the machine);
* store + fsync: the same, then an fsync of each of its files (kvcached's durability: each object is
  fsynced before it is renamed into place);
* warm load: ``engine.retrieve`` of every chunk into other KV cache blocks, the files in the page cache;
* cold load: the same after its files were dropped from the page cache (``posix_fadvise`` DONTNEED).

LMCache verifies no checksum on a load; kvcached verifies one per object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from helpfmt import show_defaults


def connector_class() -> Any:
    import torch
    from lmcache.v1.gpu_connector import GPUConnectorInterface

    class HostConnector(GPUConnectorInterface):  # type: ignore[misc]
        """Copies chunks between a host KV cache ``[2, layers, tokens, hidden]`` and LMCache's buffers."""

        def __init__(self, kv: torch.Tensor) -> None:
            self.kv = kv

        def _slices(self, start: int, end: int, **kwargs: Any) -> torch.Tensor:
            return self.kv[:, :, start:end, :]

        def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            self._slices(start, end, **kwargs).copy_(memory_obj.tensor.view(self.kv.dtype))

        def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
            memory_obj.tensor.view(self.kv.dtype).copy_(self._slices(start, end, **kwargs))

        def batched_to_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(memory_obj, start, end, **kwargs)

        def batched_from_gpu(self, memory_objs: Any, starts: Any, ends: Any, **kwargs: Any) -> None:
            for memory_obj, start, end in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(memory_obj, start, end, **kwargs)

        def get_shape(self, num_tokens: int) -> torch.Size:
            return torch.Size([2, self.kv.shape[1], num_tokens, self.kv.shape[3]])

    return HostConnector


def build(args: argparse.Namespace, directory: Path, tokens_per_chunk: int, kv: Any) -> Any:
    import torch
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata

    gib = args.blocks * args.block_bytes / 2**30
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=tokens_per_chunk,
        local_cpu=False,
        max_local_cpu_size=gib * 1.25 + 0.25,  # LMCache's buffers for the chunks in flight
        local_disk=f"file://{directory}/",
        max_local_disk_size=gib * 3 + 1,
        lmcache_instance_id=f"bench-{os.getpid()}",
    )
    metadata = LMCacheMetadata(
        model_name="bench",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(args.layers, 2, tokens_per_chunk, args.hidden, 1),
        chunk_size=tokens_per_chunk,
    )
    engine = LMCacheEngineBuilder.get_or_create(
        config.lmcache_instance_id, config, metadata, connector_class()(kv), lambda *a: None, lambda o, r: o
    )
    engine.post_init()  # makes its storage manager, as its standalone mode does
    return engine


def files(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if p.is_file()]


def wait_written(engine: Any, count: int, timeout: float = 600) -> None:
    """Until the disk backend has indexed ``count`` chunks (it does so after writing each file)."""
    disk = engine.storage_manager.storage_backends["LocalDiskBackend"]
    deadline = time.monotonic() + timeout
    while len(disk.dict) < count or disk.disk_worker.put_tasks:
        if time.monotonic() > deadline:
            raise SystemExit(f"LMCache wrote {len(disk.dict)} of {count} chunks in {timeout:.0f} s")
        time.sleep(0.0005)


def drop_from_page_cache(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (flushed first: dirty pages cannot be dropped), and
    nothing else of the machine's cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run(args: argparse.Namespace) -> dict[str, float]:
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    element = 2  # bfloat16
    tokens_per_chunk = args.block_bytes // (2 * args.layers * args.hidden * element)
    assert tokens_per_chunk * 2 * args.layers * args.hidden * element == args.block_bytes, "block bytes not even"
    total = tokens_per_chunk * args.blocks
    kv = torch.empty((2, args.layers, total, args.hidden), dtype=torch.bfloat16)
    kv.view(torch.int16).random_()
    into = torch.zeros_like(kv)  # the blocks a load fills: other blocks of the same cache
    directory = Path(args.dir)
    engine = build(args, directory, tokens_per_chunk, kv)
    mask = torch.ones(total, dtype=torch.bool)
    warmup = torch.arange(total, 2 * total, dtype=torch.long)  # other chunks: its buffers touched once, untimed
    engine.store(warmup, mask)
    wait_written(engine, args.blocks)
    engine.retrieve(warmup, mask)
    before = set(files(directory))
    tokens = torch.arange(total, dtype=torch.long)
    started = time.perf_counter()
    engine.store(tokens, mask)
    wait_written(engine, 2 * args.blocks)
    store_s = time.perf_counter() - started
    written = [path for path in files(directory) if path not in before]
    synced = time.perf_counter()
    for path in written:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    sync_s = time.perf_counter() - synced
    times = {"store_s": store_s, "store_fsync_s": store_s + sync_s}
    engine.gpu_connector.kv = into
    for name, cold in (("warm_load_s", False), ("cold_load_s", True)):
        if cold:
            drop_from_page_cache(written)
        started = time.perf_counter()
        got = engine.retrieve(tokens, mask)
        times[name] = time.perf_counter() - started
        if int(got.sum()) != total:
            raise SystemExit(f"LMCache retrieved {int(got.sum())} of {total} tokens")
    if not torch.equal(kv.view(torch.int16), into.view(torch.int16)):  # bit patterns: some are NaN
        raise SystemExit("LMCache's retrieved KV differs from what was stored")
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="an empty directory for LMCache's files")
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--block-bytes", type=int, required=True)
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True, help="kv heads x head dim")
    args = show_defaults(parser).parse_args()
    times = run(args)
    sys.stdout.flush()
    print("LMCACHE-RESULT " + json.dumps(times))
    os._exit(0)  # its background threads and event loop would hold the exit


if __name__ == "__main__":
    sys.exit(main())
