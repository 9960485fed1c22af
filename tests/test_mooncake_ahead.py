"""Loads a client sends together, through a real ``mooncake_master``: while one lands its last window, the
keeper locates the first window of the next (``Store.expect``). Each load still lands exactly its own
blocks, a miss is still a miss, and a look-ahead that is not used is dropped without putting the keeper's
replies out of step."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

import runner_client as rc
from kvcached.status import read_status
from tests.conftest import Daemon, DaemonFactory, MooncakeMaster

#: Two windows of objects per load of ``PER_LOAD`` blocks (a window is at most 32 objects).
PER_LOAD = 40
GEOMETRY: dict[str, Any] = dict(num_layers=2, kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")
FLAGS = ["--num-layers", "2", "--num-blocks", "256", "--num-cpu-blocks", "64", "--log-level", "debug"]


def keys_for(n: int, salt: int) -> list[bytes]:
    return rc.block_keys(list(range(salt, salt + 4 * n)), 4)


@contextlib.contextmanager
def attached(instance: str) -> Iterator[list[rc.KVCache]]:
    spec = rc.CacheSpec(**GEOMETRY, num_blocks=256, num_cpu_blocks=64)
    caches = [rc.initialize_kv_cache(spec, r, instance=instance, timeout=30) for r in range(2)]
    try:
        yield caches
    finally:
        for cache in caches:
            cache.close()


def fill(caches: list[rc.KVCache], ids: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for cache in caches:
        for t in cache.key_caches + cache.value_caches:
            raw = t.view(np.uint8)
            raw[ids] = rng.integers(0, 256, raw[ids].shape, dtype=np.uint8)


def blocks(caches: list[rc.KVCache], ids: list[int]) -> list[bytes]:
    return [t[i].tobytes() for cache in caches for i in ids for t in cache.key_caches + cache.value_caches]


def start(daemons: DaemonFactory, mooncake: MooncakeMaster) -> Daemon:
    daemon = daemons.start(ranks=2, args=[*FLAGS, *mooncake.args()])
    daemon.wait_ready()
    return daemon


def test_loads_sent_together_land_their_own_blocks_and_stop_at_a_miss(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Four loads sent at once: three whole prefixes of two windows each, then one whose objects run out
    after 10. Each lands its own blocks, byte for byte; the first windows of the later ones were located
    ahead (the daemon says so at debug level); the last reports 10."""
    daemon = start(daemons, mooncake)
    stored = list(range(3 * PER_LOAD))
    keys = keys_for(3 * PER_LOAD, salt=0)
    with attached(daemon.instance) as caches, rc.CacheTasks(daemon.instance) as tasks:
        fill(caches, stored, seed=1)
        expected = blocks(caches, stored)
        assert tasks.store(None, stored, keys).blocks == len(stored)
        targets = [list(range(128 + k * PER_LOAD, 128 + (k + 1) * PER_LOAD)) for k in range(3)]
        fill(caches, [i for ids in targets for i in ids], seed=2)
        short = keys[:10] + keys_for(PER_LOAD - 10, salt=10_000)  # stored, then never stored
        handles = [
            *(tasks.submit(tasks.load, None, keys[k * PER_LOAD : (k + 1) * PER_LOAD], targets[k]) for k in range(3)),
            tasks.submit(tasks.load, None, short, list(range(PER_LOAD))),
        ]
        results = [handle.result() for handle in handles]
        assert [r.blocks for r in results] == [PER_LOAD, PER_LOAD, PER_LOAD, 10]
        assert blocks(caches, [i for ids in targets for i in ids]) == expected
        assert blocks(caches, list(range(10))) == blocks(caches, list(range(128, 138)))
    assert "first window located ahead" in daemon.log()
    assert all(rank["store"]["corrupt"] == 0 for rank in read_status(daemon.instance)["ranks"])


def test_a_look_ahead_the_next_load_does_not_use_is_dropped_in_step(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """A load sent right behind another but found whole in the CPU pool leaves the locate sent ahead for it
    unused: the store's next calls (a lookup, a store, a load) get their own replies, not that one. (A
    load runs first so that the next two wait in the worker's buffer together.)"""
    daemon = start(daemons, mooncake)
    in_store, in_pool = keys_for(PER_LOAD, salt=0), keys_for(8, salt=5_000)
    with attached(daemon.instance) as caches, rc.CacheTasks(daemon.instance) as tasks:
        fill(caches, list(range(PER_LOAD)), seed=3)
        from_store = blocks(caches, list(range(PER_LOAD)))
        assert tasks.store(None, list(range(PER_LOAD)), in_store).blocks == PER_LOAD
        fill(caches, list(range(64, 72)), seed=4)
        from_pool = blocks(caches, list(range(64, 72)))
        assert tasks.swap_out(None, list(range(64, 72)), list(range(8)), keys=in_pool).blocks == 8
        busy = tasks.submit(tasks.load, None, in_store, list(range(150, 150 + PER_LOAD)))  # the next two queue
        first = tasks.submit(tasks.load, None, in_store, list(range(100, 100 + PER_LOAD)))
        second = tasks.submit(tasks.load, None, in_pool, list(range(200, 208)))
        assert [h.result().blocks for h in (busy, first, second)] == [PER_LOAD, PER_LOAD, 8]
        assert tasks.lookup(in_store) == PER_LOAD
        assert tasks.lookup(keys_for(4, salt=9_000)) == 0
        fill(caches, [240, 241], seed=5)
        assert tasks.store(None, [240, 241], keys_for(2, salt=7_000)).blocks == 2
        assert tasks.load(None, in_store[:4], [250, 251, 252, 253]).blocks == 4
        assert blocks(caches, list(range(100, 100 + PER_LOAD))) == from_store
        assert blocks(caches, list(range(200, 208))) == from_pool
        assert blocks(caches, [250, 251, 252, 253]) == blocks(caches, [0, 1, 2, 3])


def test_a_next_load_that_starts_in_the_cpu_pool_lands_the_rest_from_the_store(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """The load sent next starts with blocks the CPU pool holds and goes on with stored ones: the locate
    sent ahead (for its first keys) is not the store's part of it, so it is dropped and the store part
    located anew; every block lands."""
    daemon = start(daemons, mooncake)
    pooled, stored = keys_for(4, salt=0), keys_for(PER_LOAD, salt=30_000)
    with attached(daemon.instance) as caches, rc.CacheTasks(daemon.instance) as tasks:
        fill(caches, list(range(4 + PER_LOAD)), seed=6)
        expected = blocks(caches, list(range(4 + PER_LOAD)))
        expected_stored = blocks(caches, list(range(4, 4 + PER_LOAD)))
        assert tasks.swap_out(None, [0, 1, 2, 3], [0, 1, 2, 3], keys=pooled).blocks == 4
        assert tasks.store(None, list(range(4, 4 + PER_LOAD)), stored).blocks == PER_LOAD
        loads = [
            tasks.submit(tasks.load, None, stored, list(range(200, 200 + PER_LOAD))),  # the next two queue
            tasks.submit(tasks.load, None, stored, list(range(100, 100 + PER_LOAD))),
            tasks.submit(tasks.load, None, pooled + stored, list(range(150, 154 + PER_LOAD))),
        ]
        assert [h.result().blocks for h in loads] == [PER_LOAD, PER_LOAD, 4 + PER_LOAD]
        assert blocks(caches, list(range(150, 154 + PER_LOAD))) == expected
        assert blocks(caches, list(range(100, 100 + PER_LOAD))) == expected_stored


def test_only_the_first_keys_of_a_whole_next_load_go_ahead_and_nothing_else_does() -> None:
    """What the worker passes ahead, read from its buffer as a client left it (in-process): the first
    ``AHEAD_KEYS`` keys of a whole LOAD frame, and nothing for a partial frame, another operation, a
    payload that is not ids and keys, or garbage."""
    import socket

    from kvcached.daemon.frames import Client
    from kvcached.daemon.server import AHEAD_KEYS, _next_load
    from kvcached.protocol.messages import Op, request

    keys = keys_for(AHEAD_KEYS + 36, salt=0)
    ids = np.arange(len(keys), dtype="<i4").tobytes()
    whole = request(Op.LOAD, 7, ids + b"".join(keys))
    mine, _theirs = socket.socketpair()
    with mine, _theirs:
        client = Client(mine)
        for buffered, expected in (
            (whole, keys[:AHEAD_KEYS]),
            (request(Op.LOAD, 8, ids[:12] + b"".join(keys[:3])), keys[:3]),
            (whole[:-1], []),
            (request(Op.STORE, 9, ids + b"".join(keys)), []),
            (request(Op.LOAD, 10, ids + b"".join(keys) + b"x"), []),
            (b"KVT0" + whole[4:], []),
            (b"\x00" * 10, []),
        ):
            client.inbuf = bytearray(buffered)
            assert _next_load(client) == expected
