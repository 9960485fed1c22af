"""A long-lived runner process for the adoption tests, driven by JSON commands on stdin (one per line); it
answers each with one JSON line on stdout.

    {"do": "attach", "spec": {...}, "rank": 0, "instance": "..."}     initialize_kv_cache
    {"do": "fill", "blocks": [...], "seed": 1}                        write each block's pattern
    {"do": "check", "blocks": [...], "seed": 1}                       do the views hold the patterns?
    {"do": "loop", "src": [...], "cpu": [...]}                        swap_out those blocks again and again
                                                                      (answers once the first one is done)
    {"do": "unloop"}                                                  stop; how many tasks ran, which failed
    {"do": "swap_in", "cpu": [...], "dst": [...]}                     one swap_in with the CacheTasks it has
    {"do": "keys", "tokens": n, "out": [...], "cpu": [...]}           swap_out with the keys of n tokens
    {"do": "lookup_load", "tokens": n, "dst": [...]}                  lookup those keys, load them into dst
    {"do": "valid"}                                                   KVCache.still_valid()
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import numpy as np

import runner_client as rc


def tensors(cache: rc.KVCache) -> list[Any]:
    return [*cache.key_caches, *cache.value_caches, *cache.key_cache_scales, *cache.value_cache_scales]


def pattern(seed: int, block: int, index: int, size: int) -> np.ndarray[Any, Any]:
    """The bytes tensor ``index`` of block ``block`` holds for ``seed``."""
    return np.random.default_rng([seed, block, index]).integers(0, 256, size, dtype=np.uint8)


class Runner:
    def __init__(self) -> None:
        self.cache: rc.KVCache | None = None
        self.tasks: rc.CacheTasks | None = None
        self.rank = 0
        self.looping = False
        self.loop_thread: threading.Thread | None = None
        self.done = 0
        self.failures: list[dict[str, Any]] = []

    def attach(self, spec: dict[str, Any], rank: int, instance: str) -> dict[str, Any]:
        self.rank = rank
        self.cache = rc.initialize_kv_cache(rc.CacheSpec(**spec), rank, instance=instance, timeout=60)
        self.tasks = rc.CacheTasks(instance, timeout=30)
        return {"generation": f"{self.cache.generation:016x}"}

    def fill(self, blocks: list[int], seed: int) -> dict[str, Any]:
        assert self.cache is not None
        for index, tensor in enumerate(tensors(self.cache)):
            raw = tensor.view(np.uint8)
            for block in blocks:
                raw[block] = pattern(seed, block, index, raw[block].size).reshape(raw[block].shape)
        return {}

    def check(self, blocks: list[int], seed: int, sources: list[int] | None = None) -> dict[str, Any]:
        """Do device blocks ``blocks`` hold the patterns of ``sources`` (default: their own)?"""
        assert self.cache is not None
        bad = []
        for index, tensor in enumerate(tensors(self.cache)):
            raw = tensor.view(np.uint8)
            for block, source in zip(blocks, sources or blocks, strict=True):
                if not np.array_equal(raw[block].reshape(-1), pattern(seed, source, index, raw[block].size)):
                    bad.append(block)
        return {"ok": not bad, "bad": sorted(set(bad))}

    def loop(self, src: list[int], cpu: list[int]) -> dict[str, Any]:
        assert self.tasks is not None
        tasks = self.tasks
        self.looping = True

        def run() -> None:
            while self.looping:
                try:
                    tasks.swap_out(self.rank, src, cpu)
                    self.done += 1
                except rc.KVCacheError as exc:
                    blocks = list(getattr(exc, "blocks", ()))
                    self.failures.append({"type": type(exc).__name__, "error": str(exc), "blocks": blocks})

        self.loop_thread = threading.Thread(target=run, daemon=True)
        self.loop_thread.start()
        deadline = time.monotonic() + 60
        while not self.done and not self.failures and time.monotonic() < deadline:
            time.sleep(0.005)  # the first one done: from here on every swap writes the same bytes again
        return {"first": bool(self.done)}

    def unloop(self) -> dict[str, Any]:
        self.looping = False
        assert self.loop_thread is not None
        self.loop_thread.join(60)
        return {"done": self.done, "failures": self.failures}

    def swap_in(self, cpu: list[int], dst: list[int]) -> dict[str, Any]:
        assert self.tasks is not None
        return {"blocks": self.tasks.swap_in(self.rank, cpu, dst).blocks}

    def keys(self, tokens: int, out: list[int], cpu: list[int]) -> dict[str, Any]:
        assert self.tasks is not None and self.cache is not None
        keys = rc.block_keys(list(range(tokens)), self.cache.spec.block_size)
        return {"blocks": self.tasks.swap_out(None, out, cpu, keys=keys).blocks}

    def lookup_load(self, tokens: int, dst: list[int]) -> dict[str, Any]:
        assert self.tasks is not None and self.cache is not None
        keys = rc.block_keys(list(range(tokens)), self.cache.spec.block_size)
        found = self.tasks.lookup(keys)
        loaded = self.tasks.load(None, keys[:found], dst[:found]).blocks
        return {"found": found, "loaded": loaded}

    def valid(self) -> dict[str, Any]:
        assert self.cache is not None
        return {"valid": self.cache.still_valid(), "generation": f"{self.cache.generation:016x}"}


def main() -> None:
    runner = Runner()
    for line in sys.stdin:
        command = json.loads(line)
        action = getattr(runner, command.pop("do"))
        try:
            answer = {"ok": True, **action(**command)}
        except rc.KVCacheError as exc:
            answer = {"ok": False, "type": type(exc).__name__, "error": str(exc)}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
