"""A storage backend that exists only in the tests: each rank keeps its objects in a dict in its worker.

It shows the store seam: one module and one registration (the last line) give ``--storage-backend
testmem`` with its own option (``--testmem-objects``, ``KVCACHED_TESTMEM_OBJECTS``, ``testmem_objects`` in
TOML) and its own doctor check, when ``KVCACHED_PLUGINS=tests.plugins.memstore`` is set.
``--testmem-delay`` makes it a slow store (seconds per object), as a remote one under load can be.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvcached import knobs, store
from kvcached.checks import OK, Check
from kvcached.logs import Logger
from kvcached.protocol.errors import InvalidSpec
from kvcached.protocol.spec import CacheSpec
from kvcached.store import landing
from kvcached.store.base import (
    HEADER_SIZE,
    ObjectIdentity,
    Store,
    StoreBackend,
    StoreCounters,
    checksum,
    header_checksum,
)
from kvcached.store.landing import Targets


class MemStore(Store):
    def __init__(self, identity: ObjectIdentity, limit: int, delay: float = 0.0) -> None:
        self.identity = identity
        self.limit = limit
        self.delay = delay
        self.objects: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self.counters = StoreCounters()
        self.protected: set[bytes] = set()

    def put_many(self, keys: Sequence[bytes], pieces: Sequence[Sequence[memoryview]]) -> int:
        new = 0
        for key, parts in zip(keys, pieces, strict=True):
            time.sleep(self.delay)
            self.on_progress()
            if key in self.objects:
                continue
            self.objects[key] = self.identity.header(key, checksum(parts)) + b"".join(bytes(p) for p in parts)
            new += 1
            while len(self.objects) > self.limit:
                victim = next(k for k in self.objects if k not in self.protected)
                del self.objects[victim]
                self.counters.evictions += 1
        self.counters.objects = len(self.objects)
        self.counters.bytes = sum(len(v) for v in self.objects.values())
        return new

    def load_prefix(self, keys: Sequence[bytes], targets: Targets) -> int:
        for i, key in enumerate(keys):
            data = memoryview(self.objects.get(key, b""))
            whole = self.identity.verify_header(key, data[:HEADER_SIZE], len(data)) is None
            if not whole or landing.land(targets, [i], [data[HEADER_SIZE:]]) != [header_checksum(data)]:
                self.counters.misses += 1
                return i
            self.counters.hits += 1
        return len(keys)

    def present(self, keys: Sequence[bytes]) -> int:
        count = 0
        for key in keys:
            if key not in self.objects:
                break
            count += 1
        return count

    def protect(self, keys: Sequence[bytes]) -> None:
        self.protected = set(keys)


class MemBackend(StoreBackend):
    name = "testmem"
    options = (
        knobs.Knob("testmem_objects", knobs.integer(1), 1000, "testmem backend: objects per rank.", "N"),
        knobs.Knob("testmem_delay", knobs.seconds(0, 60), 0.0, "testmem backend: seconds per object stored.", "S"),
    )

    def configure(self, values: Mapping[str, Any], *, spec: CacheSpec, instance: str, ranks: int) -> dict[str, Any]:
        limit = values["testmem_objects"]
        if limit > 1_000_000:
            raise InvalidSpec("testmem_objects", f"at most 1000000 objects per rank, got {limit}")
        return {"testmem_objects": limit, "testmem_delay": values["testmem_delay"]}

    def open(
        self, options: Mapping[str, Any], *, identity: ObjectIdentity, rank: int, ranks: int, log: Logger
    ) -> Store:
        return MemStore(identity, options["testmem_objects"], options["testmem_delay"])

    def doctor(self, options: Mapping[str, Any], ranks: int) -> list[Check]:
        limit = options["testmem_objects"]
        return [Check("testmem", OK, f"{limit} objects per rank", {"objects": limit})]


store.register(MemBackend())
