"""The distributed tier across hosts: daemons standing for hosts (each its own instance, run directory and
Mooncake segments) on one real ``mooncake_master``; objects outlive their host's daemon.

Every load is checked byte for byte against what the storing host's device blocks held.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import runner_client as rc
from kvcached.status import read_status
from tests.conftest import Daemon, DaemonFactory, MooncakeMaster, availability, free_port, unique_instance
from tests.helpers.procs import halt

BLOCKS = 72
#: The master's client_ttl where a test waits for it to drop a dead host's segment (the master's default:
#: 10 s); the live clients' heartbeats come far more often.
CLIENT_TTL_S = 3
GEOMETRY: dict[str, Any] = dict(
    num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=BLOCKS, num_cpu_blocks=4, dtype="int8"
)
FLAGS = [
    *("--num-layers", "2", "--kv-heads", "2", "--head-dim", "16", "--block-size", "4", "--dtype", "int8"),
    *("--num-blocks", str(BLOCKS), "--num-cpu-blocks", "4"),
]


@dataclasses.dataclass
class Host:
    """One daemon standing for one host: its instance, run directory (environment) and arguments."""

    instance: str
    env: dict[str, str]
    args: list[str]
    daemon: Daemon

    def run_dir(self) -> Path:
        return Path(self.env["KVCACHED_RUN_DIR"])


def start_host(
    daemons: DaemonFactory,
    master: MooncakeMaster,
    *,
    replicas: int = 1,
    instance: str | None = None,
    extra: tuple[str, ...] = (),
) -> Host:
    instance = instance or unique_instance()
    env = daemons.env(KVCACHED_RUN_DIR=str(daemons.tmp_path / f"h{len(daemons.daemons)}"))  # short: socket paths
    args = [*FLAGS, *master.args(segment="8MiB"), "--mooncake-replicas", str(replicas), *extra]
    host = Host(instance, env, args, daemons.start(instance, ranks=2, args=args, env=env, small=False))
    host.daemon.wait_ready()
    return host


def restart_daemon(daemons: DaemonFactory, host: Host) -> None:
    """A new daemon of the host's instance (after a kill -9 or a stop --keep), ready."""
    host.daemon = daemons.start(host.instance, ranks=2, args=host.args, env=host.env, small=False)
    host.daemon.wait_ready()


@contextlib.contextmanager
def attached(host: Host) -> Iterator[list[rc.KVCache]]:
    caches = [rc.initialize_kv_cache(rc.CacheSpec(**GEOMETRY), r, instance=host.instance, timeout=30) for r in (0, 1)]
    try:
        yield caches
    finally:
        for cache in caches:
            cache.close()


def block_bytes(caches: list[rc.KVCache], ids: list[int]) -> list[bytes]:
    """Per rank, the bytes of blocks ``ids`` in every layer's key and value."""
    return [b"".join(t[i].tobytes() for i in ids for t in c.key_caches + c.value_caches) for c in caches]


def store_prefix(host: Host, count: int, salt: int) -> tuple[list[bytes], list[bytes]]:
    """Fill ``count`` device blocks of each rank of ``host`` with random bytes and store them under the
    keys of a fresh prefix; the keys and, per rank, the bytes stored."""
    keys = rc.block_keys(list(range(salt, salt + 4 * count)), 4)
    ids = list(range(count))
    with attached(host) as caches, rc.CacheTasks(host.instance) as tasks:
        rng = np.random.default_rng(salt)
        for cache in caches:
            for t in cache.key_caches + cache.value_caches:
                t.view(np.uint8)[ids] = rng.integers(0, 256, t.view(np.uint8)[ids].shape, dtype=np.uint8)
        expected = block_bytes(caches, ids)
        assert tasks.store(None, ids, keys).blocks == count
    return keys, expected


def load_prefix(host: Host, keys: list[bytes], *, first: int = 0) -> tuple[int, int, list[bytes]]:
    """Look ``keys`` up on ``host`` and load what it finds into blocks ``first``.. (scrambled first):
    (lookup, blocks loaded, per rank the bytes of the loaded blocks)."""
    ids = list(range(first, first + len(keys)))
    with attached(host) as caches, rc.CacheTasks(host.instance) as tasks:
        for cache in caches:
            for t in cache.key_caches + cache.value_caches:
                t.view(np.uint8)[ids] = 0xEE
        found = tasks.lookup(keys)
        loaded = tasks.load(None, keys, ids).blocks
        return found, loaded, block_bytes(caches, ids[:loaded])


def assert_loads(host: Host, keys: list[bytes], expected: list[bytes]) -> None:
    found, loaded, got = load_prefix(host, keys)
    assert (found, loaded) == (len(keys), len(keys)), f"{host.instance}: lookup {found}, loaded {loaded}"
    assert got == expected, "a loaded block differs from the stored one"


def keeper_pid(host: Host) -> int:
    """Pid of the host's keeper (from its socket's peer credentials)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(host.run_dir() / f"{host.instance}.mooncake.sock"))
        pid: int = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        return pid


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")


def written(host: Host) -> int:
    """Objects the host's current daemon has written to the store (both ranks)."""
    return sum(r["store"]["objects"] for r in read_status(host.instance)["ranks"])


def until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.2)


# -- sharing --------------------------------------------------------------------------------------------


def test_a_host_loads_the_prefix_another_host_stored(daemons: DaemonFactory, mooncake: MooncakeMaster) -> None:
    """Host B finds and loads, byte for byte, a 64-block prefix host A stored; a prefix nobody stored is
    a lookup of 0 and a load of 0 blocks."""
    a, b = start_host(daemons, mooncake), start_host(daemons, mooncake)
    keys, expected = store_prefix(a, 64, salt=1)
    assert_loads(b, keys, expected)
    assert_loads(a, keys, expected)
    assert load_prefix(b, rc.block_keys(list(range(5000, 5040)), 4))[:2] == (0, 0)


# -- objects outlive the daemon that wrote them -------------------------------------------------------------


def test_objects_outlive_restart_kill9_and_stop_keep_of_their_host(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Acceptance 1: after `kvcached restart` of the host that stored a 64-block prefix, after its kill -9
    (while it is down, and after `kvcached start` adopts), and after `stop --keep` and a start, the other
    host finds all 64 blocks and loads them byte for byte; the storing host's keeper is the same
    process throughout and no object is written again."""
    a, b = start_host(daemons, mooncake), start_host(daemons, mooncake)
    keys, expected = store_prefix(a, 64, salt=2)
    keeper = keeper_pid(a)
    assert written(a) > 0  # README: `objects` counts what this run of the daemon stored ...

    restarted = daemons.cli("restart", "--instance", a.instance, env=a.env)
    assert restarted.returncode == 0, restarted.stderr
    assert written(a) == 0  # ... from 0 at every start, adopting or not, while the objects stay and load
    assert_loads(b, keys, expected)

    a.daemon.kill9()
    assert_loads(b, keys, expected)  # served by A's keeper while A has no daemon at all
    restart_daemon(daemons, a)
    assert read_status(a.instance)["adopted_from"] is not None
    assert_loads(b, keys, expected)
    assert_loads(a, keys, expected)  # A itself, from its own segments

    kept = daemons.cli("stop", "--instance", a.instance, "--keep", env=a.env)
    assert kept.returncode == 0, kept.stderr
    a.daemon.exit_code()
    assert_loads(b, keys, expected)
    restart_daemon(daemons, a)
    assert_loads(b, keys, expected)

    assert keeper_pid(a) == keeper, "the keeper was replaced: its objects would have been lost"
    assert written(a) == 0, "an object was written again"


def test_a_keeper_started_with_another_configuration_is_replaced(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """A daemon started with another segment size does not use the keeper of the last run: it lets go of
    its segment (its objects leave the store) and a new one starts; the log says why."""
    a, b = start_host(daemons, mooncake), start_host(daemons, mooncake)
    keys, _ = store_prefix(a, 4, salt=3)
    old = keeper_pid(a)
    a.daemon.kill9()
    a.args = [*a.args, "--mooncake-segment", "12MiB"]
    restart_daemon(daemons, a)
    until(lambda: keeper_pid(a) != old, timeout=30, what="a new keeper")
    assert not alive(old)
    assert "mooncake keeper runs another configuration; replacing it" in a.daemon.log()
    assert load_prefix(b, keys)[:2] == (0, 0)


# -- a host gone for good ---------------------------------------------------------------------------------


def test_a_host_stopped_for_good_without_replicas_is_a_miss_not_an_error(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Acceptance 2, replicas off: `kvcached stop` (for good) lets the keeper go; the other host's lookup
    says 0 and its load loads nothing, without an error; nothing of the stopped host is left running."""
    a, b = start_host(daemons, mooncake), start_host(daemons, mooncake)
    keys, expected = store_prefix(a, 16, salt=4)
    assert_loads(b, keys, expected)
    keeper = keeper_pid(a)
    assert a.daemon.stop() == 0
    assert not alive(keeper), "the keeper outlived the final stop"
    assert not list(a.run_dir().glob(f"{a.instance}.mooncake.*")), "a keeper's file (socket, lock, log) was left"
    assert load_prefix(b, keys)[:2] == (0, 0)
    assert read_status(b.instance)["ranks"][0]["store"]["errors"] == 0


def test_with_replicas_a_host_stopped_for_good_costs_no_prefix(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Acceptance 2, replicas on: with --mooncake-replicas 2 each object has a copy in another host's
    segment, so after the storing host is stopped for good the other host still loads the prefix."""
    a = start_host(daemons, mooncake, replicas=2)
    b, c = start_host(daemons, mooncake), start_host(daemons, mooncake)
    keys, expected = store_prefix(a, 16, salt=5)
    assert a.daemon.stop() == 0
    assert_loads(b, keys, expected)
    assert_loads(c, keys, expected)


@pytest.mark.slow
@pytest.mark.parametrize("mooncake", [[f"--client_ttl={CLIENT_TTL_S}"]], indirect=True, ids=["client_ttl"])
def test_a_host_that_dies_whole_costs_misses_never_a_wrong_block(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """A host lost with everything on it (daemon and keeper killed -9): until the master drops its
    segment (its client_ttl: 10 s by default, ``CLIENT_TTL_S`` here) lookups may still count its objects,
    but loads load nothing of them and fail nothing; after that, lookups say 0."""
    a, b = start_host(daemons, mooncake), start_host(daemons, mooncake)
    keys, _ = store_prefix(a, 8, salt=6)
    keeper = keeper_pid(a)
    a.daemon.kill9()
    os.kill(keeper, signal.SIGKILL)
    found, loaded, _ = load_prefix(b, keys)
    assert loaded == 0 and found in (0, len(keys))
    until(lambda: load_prefix(b, keys)[0] == 0, timeout=40, what="lookups of a dead host's objects say 0")
    assert read_status(b.instance)["ranks"][0]["store"]["errors"] == 0
    assert read_status(b.instance)["ranks"][0]["store"]["misses"] >= 1
    restart_daemon(daemons, a)  # the host comes back (and its memory is reclaimed when the test ends)
    assert load_prefix(a, keys)[:2] == (0, 0)


# -- a rolling restart ------------------------------------------------------------------------------------


class Reader(threading.Thread):
    """A stream of cross-host lookups and loads from one host, each hit checked byte for byte."""

    def __init__(self, host: Host, prefixes: dict[str, tuple[list[bytes], list[bytes]]]) -> None:
        super().__init__(daemon=True)
        self.host, self.prefixes = host, prefixes
        self.rounds: list[dict[str, int]] = []  # per round: blocks found, per prefix
        self.wrong: list[str] = []
        self.errors: list[str] = []
        self.stopping = threading.Event()

    def wait_rounds(self, more: int) -> None:
        """Wait until ``more`` rounds have finished from now."""
        target = len(self.rounds) + more
        until(lambda: len(self.rounds) >= target or not self.is_alive(), timeout=60, what=f"{more} rounds of loads")

    def run(self) -> None:
        while not self.stopping.is_set():
            found: dict[str, int] = {}
            for name, (keys, expected) in self.prefixes.items():
                try:
                    _, loaded, got = load_prefix(self.host, keys)
                except rc.KVCacheError as exc:
                    self.errors.append(f"{name}: {exc!r}")
                    continue
                whole = [e[: len(g)] for e, g in zip(expected, got, strict=True)]
                if got != whole:
                    self.wrong.append(f"{name}: {loaded} blocks loaded, some differ")
                found[name] = loaded
            self.rounds.append(found)


def test_rolling_restart_of_three_hosts_under_a_stream_of_cross_host_loads(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Acceptance 3: three hosts each hold a prefix; a fourth host looks up and loads all three in a loop
    while each of the three is restarted in turn (`kvcached restart`): no wrong byte, no error, and every
    prefix is found whole after the last restart as before the first."""
    hosts = [start_host(daemons, mooncake) for _ in range(3)]
    prefixes = {h.instance: store_prefix(h, 16, salt=10 + i) for i, h in enumerate(hosts)}
    reader = Reader(start_host(daemons, mooncake), prefixes)
    reader.start()
    try:
        reader.wait_rounds(3)
        before = len(reader.rounds)
        for host in hosts:
            result = daemons.cli("restart", "--instance", host.instance, env=host.env)
            assert result.returncode == 0, result.stderr
            reader.wait_rounds(2)
    finally:
        reader.stopping.set()
        reader.join(60)
    assert not reader.wrong and not reader.errors, (reader.wrong, reader.errors)
    full = {name: 16 for name in prefixes}
    assert reader.rounds[:before] == [full] * before
    assert reader.rounds[-1] == full, reader.rounds[-1]
    misses = sum(1 for r in reader.rounds if r != full)
    print(f"\nrolling restart of 3 hosts: {len(reader.rounds)} rounds of 3 prefix loads, {misses} with a miss")
    assert misses == 0, "the keepers serve every object all through each restart"


def test_a_full_pool_fails_stores_and_leaves_the_store_available(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Objects of 1 MiB into a 4 MiB segment, the master's only one: once the pool has no room, a store task
    fails, naming Mooncake's code, and the store counts as available still (the master answered; status
    flapped to UNAVAILABLE at each such failure); lookups go on answering (the master may evict the first)."""
    geometry = ["--num-layers=4", "--kv-heads=8", "--head-dim=128", "--block-size=64", "--num-blocks=2"]
    daemon = daemons.start(ranks=1, args=[*geometry, "--num-cpu-blocks=0", *mooncake.args("4MiB")])
    daemon.wait_ready()
    with rc.CacheTasks(daemon.instance, timeout=30) as tasks:
        stored = 0
        for round_ in range(16):
            key = rc.block_keys(list(range(64)), 64, extra=f"full-{round_}")
            try:
                tasks.store(0, [0], key)
            except rc.StoreUnavailable as exc:
                assert "failed with code -200" in str(exc), exc  # Mooncake 0.3.13: no room
                break
            stored += 1
        else:
            raise AssertionError("16 objects of 1 MiB went into a 4 MiB pool")
        assert 0 < stored <= 4 and availability(daemon.instance) == [True]
        assert tasks.lookup(rc.block_keys(list(range(64)), 64, extra="full-0")) in (0, 1)  # (Mooncake may evict it)


# -- the master restarts ------------------------------------------------------------------------------------


def test_a_master_restart_then_a_keeper_killed_are_counted_and_the_store_comes_back(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Acceptance point 3: a master restarted without a snapshot forgets every object; the host's keeper
    notices (every rank's status and the metrics count it in master_resets) and puts the old prefix back (no
    store of it counted), and new stores and loads work again without restarting anything of kvcached. Then
    the keeper killed -9 while its daemon runs (its host's objects go with it): see ``_keeper_killed``."""
    port = free_port()
    a = start_host(daemons, mooncake, extra=("--metrics-port", str(port)))
    keys, before = store_prefix(a, 4, salt=20)
    mooncake.stop()
    mooncake.start()
    until(
        lambda: all(r["store"]["master_resets"] >= 1 for r in read_status(a.instance)["ranks"]),
        timeout=60,
        what="each rank's status counting the master's restart",
    )
    # Counted at the check that finds the marker gone; available once a put lands again (the master takes
    # puts only once the segment is mounted on it again): with no task sent, by the idle checks.
    until(lambda: all(availability(a.instance)), timeout=30, what="the store available again with no task sent")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    counted = re.search(r'kvcached_store_master_resets_total\{rank="0"\} ([0-9.]+)', metrics)
    assert counted and float(counted.group(1)) >= 1, metrics
    ranks = read_status(a.instance)["ranks"]
    assert [(r["store"]["objects"], r["store"]["bytes"]) for r in ranks] == [(0, 0)] * 2, "forgotten objects counted"
    until(lambda: load_prefix(a, keys)[:2] == (4, 4), timeout=10, what="the old prefix put back by the keeper")
    assert_loads(a, keys, before)
    again, expected = store_prefix(a, 4, salt=21)
    assert_loads(a, again, expected)
    until(lambda: written(a) == 2 * 4, timeout=10, what="the objects written since the reset, counted")
    _keeper_killed(a, again, [r["store"]["master_resets"] for r in read_status(a.instance)["ranks"]])


def _keeper_killed(a: Host, keys: list[bytes], resets: list[int]) -> None:
    """The keeper of ``a`` (holding ``keys``) killed -9 while its daemon runs (its host's objects go with it):
    status says so, then counts the store available again with no task sent, a new keeper started by the
    idle checks (a start inside a task could overrun its store timeout), the loss logged, ``objects`` 0 and
    ``master_resets`` going on from ``resets`` (a counter, though the new keeper counts from 0); store tasks
    work; the old prefix is a miss, never an error; nothing holds the dead keeper's segment memory."""
    old = keeper_pid(a)
    os.kill(old, signal.SIGKILL)
    until(lambda: not alive(old), timeout=10, what="the keeper's death")

    # Found by the idle checks, with no task; available again, a new keeper started, also with none.
    until(lambda: not all(availability(a.instance)), timeout=10, what="the keeper's death in status")
    until(lambda: all(availability(a.instance)), timeout=30, what="the store available again with no task sent")
    assert keeper_pid(a) != old
    ranks = read_status(a.instance)["ranks"]
    assert [r["store"]["objects"] for r in ranks] == [0, 0] and [r["store"]["master_resets"] for r in ranks] == resets
    assert "the Mooncake keeper was replaced" in a.daemon.log()

    def stores() -> bool:
        try:
            store_prefix(a, 4, salt=41)
            return True
        except rc.StoreUnavailable:
            return False

    until(stores, timeout=60, what="store tasks with a new keeper")
    assert keeper_pid(a) != old
    found, loaded, _ = load_prefix(a, keys)  # the master lists the dead segment's objects for client_ttl
    assert loaded == 0 and found in (0, len(keys))
    again, expected = store_prefix(a, 4, salt=42)
    assert_loads(a, again, expected)
    for worker in (r["pid"] for r in read_status(a.instance)["ranks"]):
        agents = Path(f"/proc/{worker}/task/{worker}/children").read_text().split()
        for agent in agents:
            maps = Path(f"/proc/{agent}/maps").read_text()
            assert maps.count(f"kvcached-mooncake-{a.instance} ") == 1, "an agent maps the dead keeper's segment"


def damage(host: Host, block: bytes) -> None:
    """Change 8 bytes of the object in ``host``'s segment whose payload holds ``block`` (its first 128 bytes:
    a block's key bytes of layer 0), as memory gone bad would."""
    keeper = keeper_pid(host)
    segment = next(
        Path(f"/proc/{keeper}/fd/{fd}")
        for fd in os.listdir(f"/proc/{keeper}/fd")
        if "memfd:kvcached-mooncake" in os.readlink(f"/proc/{keeper}/fd/{fd}")
    )
    with open(segment, "r+b") as f:
        data = f.read()
        where = data.find(block[:128])
        assert where > 0 and data.count(block[:128]) == 1, "the block's bytes are not in the segment once"
        f.seek(where + 100)
        f.write(b"\x00" * 8 if data[where + 100 : where + 108] != b"\x00" * 8 else b"\x01" * 8)


def test_a_corrupted_object_in_a_segment_is_a_miss(daemons: DaemonFactory, mooncake: MooncakeMaster) -> None:
    """Bytes of an object changed in place in its segment (memory gone bad, a stale index pointing at reused
    memory): the load reports the blocks before it, each byte for byte, and counts it corrupt."""
    a, b = start_host(daemons, mooncake), start_host(daemons, mooncake)
    keys, expected = store_prefix(a, 8, salt=30)
    damage(a, expected[0][4 * len(expected[0]) // 8 : 5 * len(expected[0]) // 8])  # rank 0's fifth block
    with attached(b) as caches:
        outside = block_bytes(caches, list(range(8, BLOCKS)))
    _, loaded, got = load_prefix(b, keys)
    assert loaded == 4 and got == [e[: len(g)] for e, g in zip(expected, got, strict=True)]
    with attached(b) as caches:
        assert block_bytes(caches, list(range(8, BLOCKS))) == outside, "a block outside the targets changed"
    assert read_status(b.instance)["ranks"][0]["store"]["corrupt"] == 1
    assert load_prefix(b, keys)[:2] == (4, 4), "the damaged object was removed, the ones before it kept"


def test_a_store_agent_stopped_in_a_load_costs_only_that_call(daemons: DaemonFactory, mooncake: MooncakeMaster) -> None:
    """Loads land in the device blocks from the store agent itself (``direct``): an agent frozen (SIGSTOP) in
    a load fails it with StoreUnavailable within the store timeout and is killed and reaped (nothing it had
    under way lands later); the keeper holds the objects, so a new agent loads the whole prefix byte for
    byte, and the keeper and the rank's worker are the same processes throughout."""
    a = start_host(daemons, mooncake, extra=("--store-timeout", "2"))
    keys, expected = store_prefix(a, 8, salt=50)
    keeper, worker = keeper_pid(a), read_status(a.instance)["ranks"][0]["pid"]
    (frozen,) = (int(pid) for pid in Path(f"/proc/{worker}/task/{worker}/children").read_text().split())
    halt(frozen)
    with rc.CacheTasks(a.instance, timeout=60) as tasks:
        started = time.monotonic()
        with pytest.raises(rc.StoreUnavailable, match="agent was stopped"):
            tasks.load(0, keys, list(range(8, 16)))
        assert time.monotonic() - started < 10
    assert not alive(frozen), "the frozen agent was killed and reaped"

    def loads() -> bool:
        try:
            assert_loads(a, keys, expected)
            return True
        except rc.StoreUnavailable:  # the new agent is still opening the store
            return False

    until(loads, timeout=60, what="a load by a new store agent")
    assert keeper_pid(a) == keeper and read_status(a.instance)["ranks"][0]["pid"] == worker


# -- the keeper as the operator sees it -----------------------------------------------------------------------


def keeper_check(daemons: DaemonFactory, host: Host, *extra: str) -> dict[str, Any]:
    args = ["--json", "--instance", host.instance, "--ranks", "2", *host.args, *extra]
    result = daemons.cli("doctor", *args, env=host.env)
    checks: dict[str, Any] = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    return checks


def test_doctor_shows_the_keeper_and_clean_lets_a_dead_hosts_keeper_go(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """`kvcached doctor` names the keeper and what it holds (and warns when a start with these options
    would replace it); once `doctor --clean` has reclaimed what a killed daemon left, its keeper lets go of
    the segment by itself (the instance is gone for good)."""
    a = start_host(daemons, mooncake)
    keeper = keeper_pid(a)
    check = keeper_check(daemons, a)["mooncake_keeper"]
    assert check["verdict"] == "ok" and check["measured"]["pid"] == keeper, check
    assert check["measured"]["segment_bytes"] == 2 * (8 << 20) and "the next start keeps it" in check["figure"]
    warned = keeper_check(daemons, a, "--mooncake-segment", "9MiB")["mooncake_keeper"]
    differs = "segment 16.0 MiB (2 ranks x --mooncake-segment 8.0 MiB) (this configuration: 18.0 MiB (2 ranks x "
    assert warned["verdict"] == "warn" and differs + "--mooncake-segment 9.0 MiB))" in warned["figure"], warned
    a.daemon.kill9()
    assert alive(keeper), "a killed daemon's keeper keeps its objects for the next start"
    cleaned = daemons.cli("doctor", "--clean", "--instance", a.instance, "--ranks", "2", *a.args, env=a.env)
    assert cleaned.returncode == 0, cleaned.stdout + cleaned.stderr
    until(lambda: not alive(keeper), timeout=15, what="the keeper of a cleaned instance quitting")
    assert keeper_check(daemons, a)["mooncake_keeper"]["measured"]["running"] is False
    assert not list(a.run_dir().glob(f"{a.instance}.mooncake.*")), "a keeper's file (socket, lock, log) was left"
