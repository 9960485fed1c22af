"""A real runner process for tests: initialize_kv_cache with the request given as JSON in argv[1].

Prints one JSON line: the owner, how long it waited, which mapping backs layer 0's key cache (a /dev/shm
path for a daemon arena, "" for the runner's own anonymous memory), optional value read/written, or the
error type, message and the CLOCK_MONOTONIC time at which it was raised.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import runner_client as rc
import runner_client.wait


def mapping_of(address: int) -> str:
    """The path of the mapping of this process that contains ``address`` ("" if anonymous)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= address < hi:
                return parts[5].strip() if len(parts) > 5 else ""
    raise AssertionError(f"address {address:#x} is not mapped")


def block_bytes(cache: rc.KVCache, ids: list[int]) -> list[bytes]:
    """Every tensor's bytes of the given blocks, in a fixed order."""
    tensors = cache.key_caches + cache.value_caches + cache.key_cache_scales + cache.value_cache_scales
    return [t[i].tobytes() for t in tensors for i in ids]


def swap_rounds(cache: rc.KVCache, instance: str, rank: int, rounds: int) -> bool:
    """Random data out to the CPU pool and back to other device blocks, ``rounds`` times; all equal?"""
    import numpy as np

    spec = cache.spec
    rng = np.random.default_rng(rank)
    tensors = cache.key_caches + cache.value_caches + cache.key_cache_scales + cache.value_cache_scales
    with rc.CacheTasks(instance) as tasks:
        for _ in range(rounds):
            n = int(rng.integers(1, min(spec.num_blocks, spec.num_cpu_blocks) // 2 + 1))
            src = rng.choice(spec.num_blocks, n, replace=False).tolist()
            cpu = rng.choice(spec.num_cpu_blocks, n, replace=False).tolist()
            dst = rng.choice(spec.num_blocks, n, replace=False).tolist()
            for t in tensors:
                raw = t.view(np.uint8)
                raw[src] = rng.integers(0, 256, raw[src].shape, dtype=np.uint8)
            before = block_bytes(cache, src)
            tasks.swap_out(rank, src, cpu)
            for t in tensors:
                t.view(np.uint8)[src] = 0
            tasks.swap_in(rank, cpu, dst)
            if block_bytes(cache, dst) != before:
                return False
    return True


def main() -> None:
    request: dict[str, Any] = json.loads(sys.argv[1])
    if request.get("log"):  # the runner client's log lines on stderr (tests wait for "Waiting for ...")
        import logging

        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    if "slice_s" in request:  # lengthen the liveness slice: a missed wake-up then shows as a long delay
        runner_client.wait.SLICE_S = request["slice_s"]
    spec = rc.CacheSpec(**request["spec"])
    result: dict[str, Any] = {"started_ns": time.monotonic_ns()}
    try:
        cache = rc.initialize_kv_cache(
            spec,
            request.get("rank", 0),
            profile=request.get("profile", False),
            instance=request["instance"],
            timeout=request.get("timeout", 30.0),
        )
    except rc.KVCacheError as exc:
        result.update(
            ok=False,
            error_type=type(exc).__name__,
            error=str(exc),
            raised_ns=time.monotonic_ns(),
            field=getattr(exc, "field", None),
            state=getattr(exc, "state", None),
        )
        print(json.dumps(result), flush=True)
        return
    key0 = cache.key_caches[0]
    result.update(
        ok=True,
        owner=cache.owner,
        waited_s=cache.waited_s,
        returned_ns=time.monotonic_ns(),
        generation=None if cache.generation is None else f"{cache.generation:016x}",
        mapping=mapping_of(key0.ctypes.data),
    )
    if "write" in request:
        key0.flat[request["write"]["index"]] = request["write"]["value"]
    if "read" in request:
        result["read"] = int(key0.flat[request["read"]["index"]])
    if "swap_rounds" in request:
        result["swap_ok"] = swap_rounds(cache, request["instance"], request.get("rank", 0), request["swap_rounds"])
    time.sleep(request.get("hold", 0.0))
    cache.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
