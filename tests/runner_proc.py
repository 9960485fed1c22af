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


def main() -> None:
    request: dict[str, Any] = json.loads(sys.argv[1])
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
    time.sleep(request.get("hold", 0.0))
    cache.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
