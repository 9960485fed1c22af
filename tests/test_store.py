"""Attention store tier: prefix-addressed blocks on local disk (file) and on a real Mooncake master."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import runner_client as rc
from kvcached.status import read_status
from tests.conftest import Daemon, DaemonFactory, MooncakeMaster, availability, free_port

GEOMETRY: dict[str, Any] = dict(num_layers=3, kv_heads=2, head_dim=16, block_size=4, num_blocks=16, num_cpu_blocks=8)
FLAGS = ["--num-layers", "3", "--num-blocks", "16", "--num-cpu-blocks", "8", "--dtype", "int8", "--block-wise-fp8"]


def spec(**changes: Any) -> rc.CacheSpec:
    return rc.CacheSpec(**{**GEOMETRY, "dtype": "int8", "block_wise_fp8": True, **changes})


def tensors(cache: rc.KVCache) -> list[np.ndarray]:
    return cache.key_caches + cache.value_caches + cache.key_cache_scales + cache.value_cache_scales


def fill(cache: rc.KVCache, ids: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for t in tensors(cache):
        raw = t.view(np.uint8)
        raw[ids] = rng.integers(0, 256, raw[ids].shape, dtype=np.uint8)


def blocks(cache: rc.KVCache, ids: list[int]) -> list[bytes]:
    return [t[i].tobytes() for i in ids for t in tensors(cache)]


def keys_for(n: int, salt: int = 0) -> list[bytes]:
    return rc.block_keys(list(range(salt, salt + 4 * n)), 4)


@contextlib.contextmanager
def attached(instance: str, ranks: int = 2, **changes: Any) -> Iterator[list[rc.KVCache]]:
    caches = [rc.initialize_kv_cache(spec(**changes), r, instance=instance, timeout=30) for r in range(ranks)]
    try:
        yield caches
    finally:
        for cache in caches:
            cache.close()


def start_file_daemon(
    daemons: DaemonFactory,
    path: Path,
    *,
    instance: str | None = None,
    capacity: str = "64MiB",
    extra: list[str] | None = None,
) -> Daemon:
    daemon = daemons.start(
        instance,
        ranks=2,
        args=[
            *FLAGS,
            "--storage-backend",
            "file",
            "--storage-path",
            str(path),
            "--storage-capacity",
            capacity,
            *(extra or []),
        ],
    )
    daemon.wait_ready()
    return daemon


# -- block keys ---------------------------------------------------------------------------------------


def test_block_keys_are_chained_full_blocks_only_and_stable_across_processes() -> None:
    """Key i covers the whole prefix; a partial block has no key; another process computes the same keys."""
    tokens = list(range(1000, 1023))
    keys = rc.block_keys(tokens, 4)
    assert len(keys) == 5 and all(len(k) == 32 for k in keys) and len(set(keys)) == 5
    changed = rc.block_keys([7, *tokens[1:]], 4)
    assert all(a != b for a, b in zip(keys, changed, strict=True)), "changing token 0 changes every later key"
    assert rc.block_keys(tokens[:8] + [0] * 12, 4)[:2] == keys[:2], "keys depend on the prefix only"
    code = f"import runner_client as rc; print([k.hex() for k in rc.block_keys({tokens!r}, 4)])"
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    ).stdout
    assert json.loads(other.replace("'", '"')) == [k.hex() for k in keys]


def test_block_keys_extra_and_bad_input() -> None:
    """extra (one value, or one per block) changes the keys; bad arguments name the field."""
    tokens = list(range(8))
    assert rc.block_keys(tokens, 4, extra="model-v2") != rc.block_keys(tokens, 4)
    assert rc.block_keys(tokens, 4, extra=[None, b"img"])[0] == rc.block_keys(tokens, 4)[0]
    assert rc.block_keys(tokens, 4, extra=[None, b"img"])[1] != rc.block_keys(tokens, 4)[1]
    for kwargs, field in (({"extra": [b"x"]}, "extra"), ({"block_size": 0}, "block_size"), ({"extra": 1.5}, "extra")):
        with pytest.raises(rc.InvalidArgument) as info:
            rc.block_keys(tokens, **{"block_size": 4, **kwargs})
        assert info.value.field == field
    with pytest.raises(rc.InvalidArgument) as info:
        rc.block_keys([1.5, 2.0], 1)
    assert info.value.field == "token_ids"


# -- 1. round trip on both backends ---------------------------------------------------------------------


def round_trip(instance: str) -> None:
    """Store blocks from both ranks, scramble the device, load them elsewhere: byte-equal; lookup is the
    common prefix when one rank lacks a block."""
    keys = keys_for(6)
    with attached(instance) as caches, rc.CacheTasks(instance) as tasks:
        for rank, cache in enumerate(caches):
            fill(cache, [1, 2, 3, 4, 5, 6], seed=rank)
        expected = [blocks(c, [1, 2, 3, 4, 5, 6]) for c in caches]
        assert tasks.lookup(keys) == 0
        result = tasks.store(None, [1, 2, 3, 4, 5], keys[:5])
        assert result.blocks == 5 and result.bytes == 5 * spec().block_bytes
        tasks.store(0, [6], keys[5:6])  # only rank 0 has the sixth block
        assert tasks.lookup(keys) == 5
        assert tasks.lookup(keys[:3]) == 3
        for cache in caches:
            fill(cache, list(range(16)), seed=99)
        loaded = tasks.load(None, keys, [10, 11, 12, 13, 14, 15])
        assert loaded.blocks == 5, "rank 1 stops at its first miss; the fewest of any rank is reported"
        for rank, cache in enumerate(caches):
            assert blocks(cache, [10, 11, 12, 13, 14]) == expected[rank][: 5 * 12]
        assert blocks(caches[0], [15]) == expected[0][5 * 12 :]


def test_round_trip_file_backend(daemons: DaemonFactory, tmp_path: Path) -> None:
    """file backend: store then load, all layers, keys, values and scales, N=2. A new store's rank directories hold
    every object subdirectory from the start (its first stores make none)."""
    round_trip(start_file_daemon(daemons, tmp_path / "store").instance)
    for rank in (0, 1):
        subdirectories = sorted(p.name for p in (tmp_path / "store" / f"r{rank}").iterdir() if p.is_dir())
        assert subdirectories == [f"{i:02x}" for i in range(256)]


def test_test_only_store_backend_plugs_in_with_its_own_option(daemons: DaemonFactory, tmp_path: Path) -> None:
    """A store backend from one plugin module and one registration: its option is a flag, an environment
    variable and a TOML key, is checked with the source named, shows in doctor, and the store works."""
    env = daemons.env(KVCACHED_PLUGINS="tests.plugins.memstore")
    help_text = daemons.cli("start", "--help-all", env=env).stdout
    assert "--testmem-objects" in help_text and "KVCACHED_TESTMEM_OBJECTS" in help_text and "testmem" in help_text
    bad = daemons.cli(
        "start", "--instance", "kvt-never", "--storage-backend", "testmem", "--testmem-objects", "x", env=env
    )
    assert bad.returncode == 4 and "--testmem-objects: must be an integer >= 1, got 'x'" in bad.stderr
    toml = tmp_path / "mem.toml"
    toml.write_text("testmem_objects = 2000000\n")
    bad = daemons.cli("doctor", "--storage-backend", "testmem", "--config", str(toml), env=env)
    assert bad.returncode == 1 and f"FAIL  config         {toml}: testmem_objects: at most 1000000" in bad.stdout, bad
    doctor = daemons.cli("doctor", "--json", "--storage-backend", "testmem", "--testmem-objects", "7", env=env)
    assert {"name": "testmem", "verdict": "ok"}.items() <= json.loads(doctor.stdout)["checks"][-1].items()
    daemon = daemons.start(ranks=2, args=[*FLAGS, "--storage-backend", "testmem"], env=env)
    daemon.wait_ready()
    round_trip(daemon.instance)
    assert read_status(daemon.instance)["ranks"][0]["store"]["backend"] == "testmem"


def test_round_trip_mooncake_backend(daemons: DaemonFactory, mooncake: MooncakeMaster) -> None:
    """mooncake backend against a real master on loopback: store then load, N=2."""
    daemon = daemons.start(ranks=2, args=[*FLAGS, *mooncake.args()])
    daemon.wait_ready()
    round_trip(daemon.instance)
    store = read_status(daemon.instance)["ranks"][0]["store"]
    assert store["backend"] == "mooncake" and store["objects"] == 6 and store["hits"] == 6


def test_mooncake_without_a_metadata_server(daemons: DaemonFactory, mooncake: MooncakeMaster) -> None:
    """``--mooncake-metadata P2PHANDSHAKE`` (no metadata server: the segments' hosts tell each other) is
    accepted at start and works: only the master is probed."""
    args = [*FLAGS, *mooncake.args()]
    args[args.index(mooncake.metadata)] = "P2PHANDSHAKE"
    daemon = daemons.start(ranks=2, args=args)
    daemon.wait_ready()
    round_trip(daemon.instance)
    assert read_status(daemon.instance)["ranks"][0]["store"]["hits"] == 6


def test_mooncake_objects_go_to_their_hosts_segment(daemons: DaemonFactory, mooncake: MooncakeMaster) -> None:
    """Every rank's objects are placed in the host's own segment (its keeper's: a local copy, not a TCP
    transfer to another host), whatever the master's default placement would pick."""
    from mooncake.store import MooncakeDistributedStore

    others = [daemons.start(ranks=2, args=[*FLAGS, *mooncake.args()]) for _ in range(2)]
    daemon = daemons.start(ranks=2, args=[*FLAGS, *mooncake.args()])
    for d in (*others, daemon):
        d.wait_ready()
    keys = keys_for(8)
    with rc.CacheTasks(daemon.instance) as tasks:
        tasks.store(None, list(range(8)), keys)
    probe = MooncakeDistributedStore()
    assert probe.setup("127.0.0.1", mooncake.metadata, 16 << 20, 16 << 20, "tcp", "", mooncake.address) == 0
    try:
        segments = {
            replica.get_memory_descriptor().buffer_descriptor.transport_endpoint
            for key in keys
            for rank in (0, 1)
            for replica in probe.get_replica_desc(f"kvcached/{spec().geometry_digest.hex()}/{key.hex()}/r{rank}")
        }
    finally:
        probe.close()
    log = (daemons.run_dir / f"{daemon.instance}.mooncake.log").read_text()
    assert len(segments) == 1 and f'"segment": "{next(iter(segments))}"' in log, segments


# -- 2. restart -----------------------------------------------------------------------------------------


def test_new_daemon_serves_blocks_of_the_previous_one(daemons: DaemonFactory, tmp_path: Path) -> None:
    """A new daemon on the same directory finds the objects the previous one stored (index rebuilt)."""
    path = tmp_path / "store"
    first = start_file_daemon(daemons, path)
    keys = keys_for(4)
    with attached(first.instance) as caches, rc.CacheTasks(first.instance) as tasks:
        for rank, cache in enumerate(caches):
            fill(cache, [0, 1, 2, 3], seed=rank + 5)
        expected = [blocks(c, [0, 1, 2, 3]) for c in caches]
        tasks.store(None, [0, 1, 2, 3], keys)
    assert first.stop() == 0
    second = start_file_daemon(daemons, path, instance=first.instance)
    assert read_status(second.instance)["ranks"][0]["store"]["objects"] == 4
    with attached(second.instance) as caches, rc.CacheTasks(second.instance) as tasks:
        assert tasks.lookup(keys) == 4
        assert tasks.load(None, keys, [8, 9, 10, 11]).blocks == 4
        assert [blocks(c, [8, 9, 10, 11]) for c in caches] == expected


# -- 3. corruption ----------------------------------------------------------------------------------------


def object_path(root: Path, rank: int, key: bytes) -> Path:
    return root / f"r{rank}" / key.hex()[:2] / f"{key.hex()}.kvb"


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign"])
def test_damaged_object_reads_as_miss_and_is_removed(daemons: DaemonFactory, tmp_path: Path, damage: str) -> None:
    """A truncated, bit-flipped or foreign object is a miss: the load reports only the block before it, that
    block holds its bytes, the damaged object is removed, no block outside the load's targets changes (the
    unreported targets were handed over as free receivers), and the daemon serves on."""
    path = tmp_path / "store"
    daemon = start_file_daemon(daemons, path)
    keys = keys_for(3)
    with attached(daemon.instance) as caches, rc.CacheTasks(daemon.instance) as tasks:
        fill(caches[0], [1, 2, 3], seed=1)
        fill(caches[1], [1, 2, 3], seed=2)
        tasks.store(None, [1, 2, 3], keys)
        victim = object_path(path, 0, keys[1])
        raw = bytearray(victim.read_bytes())
        if damage == "truncate":
            victim.write_bytes(raw[: len(raw) // 2])
        elif damage == "flip":
            raw[len(raw) - 7] ^= 0x40
            victim.write_bytes(raw)
        else:
            victim.write_bytes(np.random.default_rng(3).integers(0, 256, len(raw), dtype=np.uint8).tobytes())
        fill(caches[0], [8, 9, 10], seed=42)
        expected_first = blocks(caches[0], [1])
        outside = [i for i in range(caches[0].spec.num_blocks) if i not in (8, 9, 10)]
        before = blocks(caches[0], outside), blocks(caches[1], list(range(caches[1].spec.num_blocks)))
        result = tasks.load(0, keys, [8, 9, 10])
        assert result.blocks == 1, "loading stops at the damaged second block"
        assert blocks(caches[0], [8]) == expected_first, "the reported block holds its object's bytes"
        after = blocks(caches[0], outside), blocks(caches[1], list(range(caches[1].spec.num_blocks)))
        assert after == before, "no block outside the load's targets changed"
        assert not victim.exists()
        assert tasks.lookup(keys) == 1
        tasks.store(None, [2], keys[1:2])  # and it can be stored again
        assert tasks.lookup(keys) == 3
    store = read_status(daemon.instance)["ranks"][0]["store"]
    assert store["corrupt"] == 1


def test_foreign_files_and_other_geometry_are_misses(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Objects stored under another geometry, and a foreign file named like an object, never load; a daemon
    restarted with the old geometry still serves its own."""
    path = tmp_path / "store"
    first = start_file_daemon(daemons, path)
    keys = keys_for(2)
    with attached(first.instance) as caches, rc.CacheTasks(first.instance) as tasks:
        fill(caches[0], [1, 2], seed=4)
        fill(caches[1], [1, 2], seed=5)
        tasks.store(None, [1, 2], keys)
    assert first.stop() == 0
    stranger = rc.block_keys(list(range(500, 504)), 4)[0]
    object_path(path, 0, stranger).parent.mkdir(parents=True, exist_ok=True)
    object_path(path, 0, stranger).write_bytes(b"not a block" * 100)
    (path / "r0" / "notes.txt").write_text("someone else's file")
    other = start_file_daemon(daemons, path, instance=first.instance, extra=["--num-blocks", "20"])
    with attached(other.instance, num_blocks=20) as caches, rc.CacheTasks(other.instance) as tasks:
        assert tasks.lookup(keys) == 0 and tasks.lookup([stranger]) == 0
        fill(caches[0], [5, 6], seed=6)
        before = blocks(caches[0], [5, 6])
        assert tasks.load(None, keys, [5, 6]).blocks == 0
        assert blocks(caches[0], [5, 6]) == before
        assert tasks.swap_out(None, [1], [1]).blocks == 1, "the daemon serves on"
    assert not object_path(path, 0, stranger).exists() and (path / "r0" / "notes.txt").exists()


def test_kill9_during_store_leaves_no_incomplete_object(daemons: DaemonFactory, tmp_path: Path) -> None:
    """A daemon killed in the middle of a long store: after restart every object that loads is whole and
    equal to what was stored; no temporary file is left."""
    path = tmp_path / "store"
    flags = [
        "--num-layers",
        "4",
        "--kv-heads",
        "8",
        "--head-dim",
        "128",
        "--block-size",
        "64",
        "--num-blocks",
        "96",
        "--num-cpu-blocks",
        "0",
        "--storage-backend",
        "file",
        "--storage-path",
        str(path),
        "--storage-capacity",
        "1GiB",
    ]
    daemon = daemons.start(ranks=1, args=flags)
    daemon.wait_ready()
    big = rc.CacheSpec(num_layers=4, kv_heads=8, head_dim=128, block_size=64, num_blocks=96, storage_backend="file")
    keys = rc.block_keys(list(range(64 * 96)), 64)
    cache = rc.initialize_kv_cache(big, 0, instance=daemon.instance)
    rng = np.random.default_rng(8)
    for t in cache.key_caches + cache.value_caches:
        t.view(np.uint8)[...] = rng.integers(0, 256, t.view(np.uint8).shape, dtype=np.uint8)
    expected = {i: b"".join(t[i].tobytes() for t in cache.key_caches + cache.value_caches) for i in range(96)}
    tasks = rc.CacheTasks(daemon.instance)
    tasks.submit(tasks.store, 0, list(range(96)), keys)
    deadline = time.monotonic() + 30
    while not any(path.glob("r0/*/*.kvb")) and time.monotonic() < deadline:
        time.sleep(0.005)
    daemon.kill9()
    tasks.close()
    cache.close()
    stored_before_restart = len(list(path.glob("r0/*/*.kvb")))
    assert 0 < stored_before_restart < 96, "the kill landed in the middle of the store"
    again = daemons.start(daemon.instance, ranks=1, args=flags)
    again.wait_ready()
    assert not list(path.glob("r0/*/.tmp-*")), "half-written temporaries are removed at start-up"
    with rc.initialize_kv_cache(big, 0, instance=daemon.instance) as cache, rc.CacheTasks(daemon.instance) as tasks:
        present = [i for i in range(96) if tasks.lookup([keys[i]]) == 1]
        assert len(present) >= stored_before_restart - 1
        for i in present:
            assert tasks.load(0, [keys[i]], [0]).blocks == 1
            assert b"".join(t[0].tobytes() for t in cache.key_caches + cache.value_caches) == expected[i]


# -- 4. capacity ------------------------------------------------------------------------------------------


def test_capacity_evicts_least_recently_used(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Past the capacity the least recently used objects go; lookup never reports an evicted one."""
    per_object = 128 + spec().block_bytes
    daemon = start_file_daemon(daemons, tmp_path / "store", capacity=str(2 * 4 * per_object))  # 4 per rank
    keys = [rc.block_keys([n] * 4, 4)[0] for n in range(8)]
    with attached(daemon.instance) as caches, rc.CacheTasks(daemon.instance) as tasks:
        for cache in caches:
            fill(cache, list(range(8)), seed=9)
        tasks.store(None, [0, 1, 2, 3], keys[:4])
        assert tasks.load(None, [keys[0]], [12]).blocks == 1  # key 0 is now the most recently used
        tasks.store(None, [4, 5], keys[4:6])
        assert [tasks.lookup([k]) for k in keys[:6]] == [1, 0, 0, 1, 1, 1]
        tasks.store(None, [6, 7], keys[6:8])
        assert [tasks.lookup([k]) for k in keys] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert tasks.load(None, [keys[1]], [12]).blocks == 0
    store = read_status(daemon.instance)["ranks"][1]["store"]
    assert store["evictions"] == 4 and store["objects"] == 4 and store["bytes"] <= 4 * per_object
    assert len(list((tmp_path / "store" / "r1").glob("*/*.kvb"))) == 4


# -- 5. Mooncake master down and back ---------------------------------------------------------------------


def becomes(instance: str, wanted: list[bool], what: str) -> None:
    """Wait (30 s at most) until ``availability`` is ``wanted``."""
    deadline = time.monotonic() + 30
    while availability(instance) != wanted:
        assert time.monotonic() < deadline, f"{what}: still {availability(instance)} after 30 s"
        time.sleep(0.2)


def test_mooncake_master_down_then_back(daemons: DaemonFactory, mooncake: MooncakeMaster) -> None:
    """A daemon started while its Mooncake master is down starts and serves swaps, and says its store is
    unavailable (status JSON and table, the metrics gauge) from its start; once the master is up, every
    rank counts its store available again within seconds, with no task sent, connected (its keeper started
    by the idle checks), and the store works at the first task. A master
    that then dies while no store task runs is found within seconds too (the keeper checks it each second);
    store, lookup and load fail with a clear error while swaps go on. (A master back from a restart:
    ``test_mooncake_hosts.py::test_a_master_restart_then_a_keeper_killed_are_counted_and_the_store_comes_back``.)"""
    mooncake.stop()
    port = free_port()
    daemon = daemons.start(ranks=2, args=[*FLAGS, *mooncake.args(), "--metrics-port", str(port)])
    daemon.wait_ready()

    def gauge() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        found = re.search(r'^kvcached_store_unavailable\{rank="1"\} ([0-9.]+)$', metrics, re.M)
        assert found, metrics
        return found.group(1)

    def shown() -> bool:
        return "UNAVAILABLE" in daemons.cli("status", "--instance", daemon.instance).stdout

    assert availability(daemon.instance) == [False, False] and gauge() == "1.0"
    keys = keys_for(2)
    with attached(daemon.instance) as caches, rc.CacheTasks(daemon.instance) as tasks:
        assert tasks.swap_out(None, [1], [0]).blocks == 1
        mooncake.start()
        becomes(daemon.instance, [True, True], "the master up")
        assert gauge() == "0.0" and not shown()  # (the table's UNAVAILABLE: after the master is killed, below)
        assert (daemons.run_dir / f"{daemon.instance}.mooncake.sock").exists(), "no keeper started"
        fill(caches[0], [1, 2], seed=10)
        tasks.store(None, [1, 2], keys)  # connected on every rank
        mooncake.stop()
        becomes(daemon.instance, [False, False], "the master killed while the store is idle")
        assert shown()
        for call in (
            lambda: tasks.store(None, [3], keys_for(1, salt=50)),
            lambda: tasks.lookup(keys),
            lambda: tasks.load(None, keys, [5, 6]),
        ):
            with pytest.raises(rc.TaskFailed, match="storage backend unavailable"):
                call()
        assert tasks.swap_out(None, [1, 2], [0, 1]).blocks == 2
        assert tasks.swap_in(None, [0, 1], [7, 8]).blocks == 2
        assert daemon.proc.poll() is None
    assert read_status(daemon.instance)["ranks"][0]["store"]["errors"] >= 3
    assert daemon.stop() == 0


def test_a_store_whose_keeper_cannot_start_stays_unavailable_though_its_master_answers(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """The master answers, but the keeper cannot start (its --mooncake-host is no address of this host): the
    store stays unavailable (the idle probe, which only connects, would count a master that takes
    connections as back), and a store task fails saying why."""
    daemon = daemons.start(ranks=2, args=[*FLAGS, *mooncake.args(), "--mooncake-host", "203.0.113.7"])
    daemon.wait_ready()
    with rc.CacheTasks(daemon.instance, timeout=30) as tasks:
        deadline = time.monotonic() + 30
        while True:  # "still connecting" until the agent's open has failed
            with pytest.raises(rc.StoreUnavailable) as failed:
                tasks.lookup(keys_for(1, salt=90))
            if "keeper did not start" in str(failed.value):
                break
            assert time.monotonic() < deadline, str(failed.value)
            time.sleep(0.2)
        seen = time.monotonic()
        while time.monotonic() - seen < 1.3:  # an idle check and its probe come each second
            assert availability(daemon.instance) == [False, False]
            time.sleep(0.2)
    assert daemon.stop() == 0


def test_a_store_counts_as_unavailable_until_it_is_open(daemons: DaemonFactory, tmp_path: Path) -> None:
    """While a rank allocates (here held 1.5 s) its store is not open yet: status says unavailable, not the
    zeros of an empty slot; once READY the file store is open and available."""
    args = [*FLAGS, "--storage-backend", "file", "--storage-path", str(tmp_path / "store")]
    env = daemons.env(KVCACHED_FAULT="worker-allocating:sleep=1.5")
    daemon = daemons.start(ranks=2, args=args, env=env)
    daemon.wait_state("ALLOCATING")
    time.sleep(0.2)  # each worker is in its allocation by now
    assert availability(daemon.instance) == [False, False]
    daemon.wait_ready()
    assert availability(daemon.instance) == [True, True]
    assert daemon.stop() == 0


# -- tasks and configuration --------------------------------------------------------------------------------


def test_write_through_swap_out(daemons: DaemonFactory, tmp_path: Path) -> None:
    """swap_out with keys also writes the blocks to the store."""
    daemon = start_file_daemon(daemons, tmp_path / "store")
    keys = keys_for(2)
    with attached(daemon.instance) as caches, rc.CacheTasks(daemon.instance) as tasks:
        fill(caches[1], [3, 4], seed=11)
        expected = blocks(caches[1], [3, 4])
        tasks.swap_out(None, [3, 4], [0, 1], keys=keys)
        assert tasks.lookup(keys) == 2
        tasks.load(1, keys, [13, 14])
        assert blocks(caches[1], [13, 14]) == expected


def test_bad_store_tasks_are_refused(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Bad keys, ids, duplicate targets, or no store configured: InvalidTask naming the field."""
    daemon = start_file_daemon(daemons, tmp_path / "store")
    keys = keys_for(2)
    with rc.CacheTasks(daemon.instance) as tasks:
        for call, field in [
            (lambda: tasks.store(0, [1], [b"short"]), "keys"),
            (lambda: tasks.store(0, [1, 2], keys[:1]), "keys"),
            (lambda: tasks.store(0, [16], keys[:1]), "device_block_ids"),
            (lambda: tasks.load(0, keys, [3, 3]), "device_block_ids"),
            (lambda: tasks.lookup(keys[0]), "keys"),
            (lambda: tasks.swap_out(0, [1], [1], keys=[b"x" * 31]), "keys"),
        ]:
            with pytest.raises(rc.InvalidTask) as info:
                call()
            assert info.value.field == field
    plain = daemons.start(ranks=1)
    plain.wait_ready()
    with rc.CacheTasks(plain.instance) as tasks, pytest.raises(rc.InvalidTask) as info:
        tasks.store(0, [1], keys[:1])
    assert info.value.field == "storage_backend"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--storage-backend", "mooncake"],
            "--mooncake-master: is required with --storage-backend mooncake, e.g. 127.0.0.1:50051 (or, under "
            "Mooncake's HA, 'etcd://E1:2379;E2:2379'); so is "
            "--mooncake-metadata, e.g. http://127.0.0.1:8080/metadata (docs/mooncake.md says how to start a master)",
        ),
        (
            ["--storage-backend", "mooncake", "--mooncake-master", "h:1"],
            "--mooncake-metadata: is required with --storage-backend mooncake, e.g. http://127.0.0.1:8080/metadata",
        ),
        (["--storage-backend", "redis"], "--storage-backend: unknown storage backend 'redis'; known: file, mooncake"),
        (
            ["--storage-backend", "mooncake", "--mooncake-master", "x", "--mooncake-metadata", "http://h:1/m"],
            "must be HOST:PORT",
        ),
        (
            ["--storage-backend", "mooncake", "--mooncake-master", "h:1", "--mooncake-metadata", "h:8080/metadata"],
            "--mooncake-metadata: must name its scheme: http://HOST:PORT/metadata",
        ),
        (
            ["--storage-backend", "mooncake", "--mooncake-master", "h:99999", "--mooncake-metadata", "http://h:1/m"],
            "--mooncake-master: must be HOST:PORT (a port from 1 to 65535)",
        ),
        (
            ["--storage-backend", "mooncake", "--mooncake-master", "h:\u00b2", "--mooncake-metadata", "http://h:1/m"],
            "--mooncake-master: must be HOST:PORT (a port from 1 to 65535)",
        ),
        (
            ["--storage-backend", "mooncake", "--mooncake-master", "etcd://h:1;h", "--mooncake-metadata", "etcd://h:1"],
            "--mooncake-master: must be HOST:PORT (a port from 1 to 65535), or etcd://HOST:PORT[;HOST:PORT...]",
        ),
        *(
            (
                ["--storage-backend", "mooncake", "--mooncake-master", bad, "--mooncake-metadata", "etcd://h:1"],
                f"--mooncake-master: must be HOST:PORT (a port from 1 to 65535), or etcd://HOST:PORT[;HOST:PORT...] "
                f"(the etcd servers of Mooncake's HA masters); got {bad!r}",
            )
            for bad in ("etcd:/h:2379", "etcd://a b:2379", "h\nx:1", "etcd://h:1;", "[::1:80")
        ),
        (
            ["--storage-backend", "mooncake", "--mooncake-master", "redis://h:1", "--mooncake-metadata", "etcd://h:1"],
            "(the etcd servers of Mooncake's HA masters); got 'redis://h:1'",
        ),
        (
            [
                *("--storage-backend", "mooncake", "--mooncake-master", "h:1"),
                *("--mooncake-metadata", "http://h:1/m", "--mooncake-republish-rate", "fast"),
            ],
            "--mooncake-republish-rate: must be a size in bytes",
        ),
        (
            ["--storage-backend", "mooncake", "--mooncake-master", "h:1", "--mooncake-metadata", "http://h:abc/m"],
            "--mooncake-metadata: the port after the host must be a number from 1 to 65535",
        ),
        (
            ["--storage-backend", "mooncake", "--mooncake-master", "h:1", "--mooncake-metadata", "HTTP://h:1/m"],
            "--mooncake-metadata: must name its scheme",
        ),
        (["--storage-backend", "file", "--storage-capacity", "lots"], "--storage-capacity: must be a size in bytes"),
        (["--storage-backend", "file", "--storage-capacity", "10"], "cannot hold one block per rank"),
        (  # a path the kernel takes, whose objects' names it would not
            ["--storage-backend", "file", "--storage-path", "/tmp/" + "/".join(["d" * 251] * 16)],
            "is too long: its objects' names would take 4111 bytes, past this system's 4095",
        ),
    ],
)
def test_bad_store_configuration(daemons: DaemonFactory, args: list[str], message: str) -> None:
    """Store options are checked at start-up (exit 4), naming the flag."""
    daemon = daemons.start(ranks=1, args=args)
    assert daemon.exit_code() == 4
    assert message in daemon.log()


def test_status_shows_store_figures(daemons: DaemonFactory, tmp_path: Path) -> None:
    """kvcached status shows objects, bytes, hits, misses and evictions of the store per rank."""
    daemon = start_file_daemon(daemons, tmp_path / "store")
    keys = keys_for(3)
    with rc.CacheTasks(daemon.instance) as tasks:
        tasks.store(None, [1, 2], keys[:2])
        tasks.load(None, keys, [5, 6, 7])
    store = read_status(daemon.instance)["ranks"][0]["store"]
    assert (store["objects"], store["hits"], store["misses"], store["evictions"]) == (2, 2, 1, 0)
    assert store["bytes"] == 2 * (128 + spec().block_bytes)
    table = daemons.cli("status", "--instance", daemon.instance).stdout
    assert "file: 2 obj" in table and "hit 2 miss 1 evict 0" in table


OTHER_UID = 65534


@pytest.mark.parametrize("via", ["a link in another user's directory", "a link another user owns, further on"])
def test_a_store_path_through_a_link_another_user_can_turn_is_refused(
    daemons: DaemonFactory, tmp_path: Path, via: str
) -> None:
    """The store directory is the daemon's own and closed, but the path as given goes through a symbolic
    link another user could point at a directory of their own (planted objects would then load as
    verified): the start fails (exit 4) naming the link; the resolved path starts."""
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, OTHER_UID, OTHER_UID)
    if via == "a link in another user's directory":
        link = theirs / "store"
        link.symlink_to(real)
        given = link
    else:
        link = theirs / "hop"
        link.symlink_to(real)
        os.lchown(link, OTHER_UID, OTHER_UID)
        ours = tmp_path / "ours"
        ours.mkdir(mode=0o700)
        (ours / "store").symlink_to(link)
        given = ours / "store"
    daemon = daemons.start(ranks=1, args=[*FLAGS, "--storage-backend", "file", "--storage-path", str(given)])
    assert daemon.exit_code() == 4
    assert f"{link}, a symbolic link on the way to the store directory" in daemon.log(), daemon.log()[-1500:]
    assert list(real.iterdir()) == [], "the refused store was changed"
    start_file_daemon(daemons, real)


def test_an_object_subdirectory_linked_to_another_users_directory_is_refused(
    daemons: DaemonFactory, tmp_path: Path
) -> None:
    """A hostile pass: a symbolic link at an object subdirectory's name (``r0/ab``) to a directory another user can
    write fails the start (exit 4) naming it, as such a subdirectory itself does; it passed unchecked, and stores of
    keys beginning ``ab`` went there, outside the store, for loads to serve whatever that user put beside them."""
    path = tmp_path / "store"
    (path / "r0").mkdir(parents=True)
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    theirs.chmod(0o777)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    (path / "r0" / "ab").symlink_to(theirs)
    daemon = daemons.start(ranks=1, args=[*FLAGS, "--storage-backend", "file", "--storage-path", str(path)])
    assert daemon.exit_code() == 4
    assert f"{path / 'r0' / 'ab'} is owned by uid {OTHER_UID}" in daemon.log(), daemon.log()[-1500:]
    assert list(theirs.iterdir()) == []


@pytest.mark.parametrize("made", ["by another user", "group-writable"])
def test_a_store_directory_others_can_write_is_refused(daemons: DaemonFactory, tmp_path: Path, made: str) -> None:
    """A store directory made beforehand by another user (in a shared, sticky directory), or the daemon's
    own but writable by its group: the start fails (exit 4) naming the path, its owner and mode and the fix,
    and ``doctor`` says the same; nothing in it changes. After the fix the daemon starts on it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    path = shared / "kvstore"
    if made == "by another user":
        for directory in (path, path / "r0"):  # as that user's mkdir leaves them (its umask aside)
            directory.mkdir()
            directory.chmod(0o777)
            os.chown(directory, OTHER_UID, OTHER_UID)
        owner, mode = f"uid {OTHER_UID}", "0777"
    else:
        path.mkdir(mode=0o770)
        path.chmod(0o770)
        owner, mode = "uid 0", "0770"
    before = sorted(str(p) for p in path.rglob("*"))
    daemon = daemons.start(ranks=1, args=[*FLAGS, "--storage-backend", "file", "--storage-path", str(path)])
    assert daemon.exit_code() == 4
    refusal = f"{path} is owned by {owner}"
    assert refusal in daemon.log() and f"with mode {mode}" in daemon.log() and "chmod go-w" in daemon.log()
    assert sorted(str(p) for p in path.rglob("*")) == before, "the refused directory was changed"
    doctor = daemons.cli("doctor", "--ranks", "1", "--storage-backend", "file", "--storage-path", str(path))
    assert refusal in doctor.stdout + doctor.stderr
    os.chown(path, 0, 0)
    path.chmod(0o700)
    for sub in path.iterdir():
        os.chown(sub, 0, 0)
        sub.chmod(0o700)
    start_file_daemon(daemons, path)
