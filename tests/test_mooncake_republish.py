"""The distributed tier heals itself: after its master forgot every object (killed -9 and started again without a
snapshot), each host's keeper puts its own share back, most recently used first, with no engine storing
again. Daemons standing for hosts on one real ``mooncake_master``; every load checked byte for byte."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import runner_client as rc
from kvcached.protocol.spec import CacheSpec
from kvcached.status import read_status, render
from kvcached.store.mooncake_republish import Republisher
from tests.conftest import DaemonFactory, MooncakeMaster, availability, free_port
from tests.helpers.procs import halt
from tests.test_mooncake_hosts import (
    GEOMETRY,
    Host,
    assert_loads,
    damage,
    load_prefix,
    start_host,
    store_prefix,
    until,
    written,
)


class Looker(threading.Thread):
    """Host ``host`` looks ``keys`` up and loads them in a loop: what each round found, the errors met, and any
    loaded block that differs from what was stored."""

    def __init__(self, host: Host, keys: list[bytes], expected: list[bytes]) -> None:
        super().__init__(daemon=True)
        self.host, self.keys, self.expected = host, keys, expected
        self.found: list[tuple[float, int, int]] = []  # (when, lookup, loaded)
        self.unavailable = 0
        self.errors: list[str] = []
        self.wrong: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.05):
            try:
                found, loaded, got = load_prefix(self.host, self.keys)
            except rc.StoreUnavailable:
                self.unavailable += 1
                continue
            except rc.KVCacheError as exc:
                self.errors.append(repr(exc))
                continue
            if got != [block[: len(block) * loaded // len(self.keys)] for block in self.expected]:
                self.wrong.append(f"{loaded} blocks loaded, some differ")
            self.found.append((time.monotonic(), found, loaded))

    def whole_since(self, since: float, timeout: float) -> float:
        """Seconds from ``since`` to the first round that found and loaded every key."""
        whole = (len(self.keys), len(self.keys))

        def times() -> list[float]:
            return [when for when, *got in self.found if when >= since and tuple(got) == whole]

        until(lambda: bool(times()), timeout, "the whole prefix")
        return min(times()) - since

    def stop(self) -> None:
        self.stopping.set()
        self.join(60)
        assert not self.errors and not self.wrong, (self.errors, self.wrong)


def republish(host: Host) -> list[dict[str, Any]]:
    """Each rank's ``store.republish`` figures in ``kvcached status --json``."""
    return [r["store"]["republish"] for r in read_status(host.instance)["ranks"]]


def back(host: Host, objects: int) -> bool:
    """Whether every rank of ``host`` has put back ``objects`` objects and has none to go."""
    return all(f["done"] == objects and f["to_go"] == 0 for f in republish(host))


def test_after_a_master_restart_the_other_host_loads_the_whole_prefix_within_10_s(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Acceptance 1: host A stores a 64-block prefix; the master is killed -9 and started again without a
    snapshot. Within 10 s of the master taking connections host B finds the whole prefix and loads it byte for
    byte, and A's engine stored nothing again (A's keeper put its 64 objects of each rank back). B's lookups and
    loads in between are misses or ``StoreUnavailable``, never another error or a wrong block."""
    a, b = start_host(daemons, mooncake), start_host(daemons, mooncake)
    keys, expected = store_prefix(a, 64, salt=60)
    looker = Looker(b, keys, expected)
    looker.start()
    try:
        until(lambda: len(looker.found) >= 2, 30, "B's loads before the restart")
        mooncake.stop()
        mooncake.start()
        took = looker.whole_since(time.monotonic(), timeout=60)
    finally:
        looker.stop()
    print(f"\nmaster restarted: B found the whole prefix {took:.2f}s after the master took connections")
    assert took <= 10, f"{took:.1f}s"
    assert_loads(b, keys, expected)
    until(lambda: back(a, 64), 10, "A's figures")
    assert written(a) == 0, "A's engine stored again"
    assert all(r["store"]["master_resets"] == 1 for r in read_status(a.instance)["ranks"])


def keeper_events(host: Host, event: str) -> list[dict[str, Any]]:
    """The host keeper's log records whose event begins with ``event``."""
    lines = (host.run_dir() / f"{host.instance}.mooncake.log").read_text(errors="replace").splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    return [r for r in records if str(r.get("event", "")).startswith(event)]


def midway(host: Host, objects: int) -> None:
    """Wait until ``host`` has put back some of its ``objects`` objects a rank, and not all, as every rank's
    status says (its ranks' objects go back in the order they were used, so one rank's may all go first)."""

    def under_way() -> bool:
        figures = republish(host)
        counted = all(f["done"] + f["failed"] + f["to_go"] == objects for f in figures)
        return counted and sum(f["done"] for f in figures) > 0 and sum(f["to_go"] for f in figures) > 0

    until(under_way, 30, "a put back under way")


AS_NEIGHBOUR = ["setpriv", "--reuid", "64012", "--regid", "64012", "--clear-groups", "--"]
SLOW = ("--mooncake-republish-rate", "8KiB")  # 128 objects of 640 bytes: four batches, 2.5 s apart


def test_a_daemon_restarted_while_its_keeper_puts_back_loses_nothing(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Acceptance 2: A's daemon restarted (`kvcached restart`) while its keeper is putting its objects back: the
    keeper (the same process) goes on, and B loads A's whole prefix byte for byte; every object was put back
    exactly once (64 a rank), none skipped or failed, and A's engine stored nothing again, at no more than the
    rate asked for. B's lookups and loads all along are misses or ``StoreUnavailable``, never another error or
    a wrong block."""
    a, b = start_host(daemons, mooncake, extra=SLOW), start_host(daemons, mooncake)
    keys, expected = store_prefix(a, 64, salt=61)
    looker = Looker(b, keys, expected)  # B's lookups and loads all along: misses, never an error or a wrong block
    looker.start()
    try:
        mooncake.stop()
        mooncake.start()
        midway(a, 64)
        restarted = daemons.cli("restart", "--instance", a.instance, env=a.env)
        assert restarted.returncode == 0, restarted.stderr
        until(lambda: back(a, 64), 30, "A's objects all back")
    finally:
        looker.stop()
    assert_loads(b, keys, expected)
    assert [(f["skipped"], f["failed"]) for f in republish(a)] == [(0, 0)] * 2
    assert written(a) == 0
    assert sum(f["rate_bytes_s"] for f in republish(a)) <= 8192 * 1.01, republish(a)  # the limit, kept over the round


def test_a_second_master_reset_during_the_put_back_starts_it_over(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Acceptance 2: the master reset again while A's keeper is putting back what it forgot the first time: the
    keeper starts over with every object once (what it put back meanwhile copied out of the segment again, what
    was still to go kept), and B then loads the whole prefix byte for byte; nothing failed, nothing skipped;
    B's lookups and loads all along are misses or ``StoreUnavailable``, never another error or a wrong block."""
    a, b = start_host(daemons, mooncake, extra=SLOW), start_host(daemons, mooncake)
    keys, expected = store_prefix(a, 64, salt=62)
    looker = Looker(b, keys, expected)
    looker.start()
    try:
        mooncake.stop()
        mooncake.start()
        midway(a, 64)
        mooncake.stop()
        mooncake.start()

        def resets() -> bool:
            return all(r["store"]["master_resets"] == 2 for r in read_status(a.instance)["ranks"])

        until(resets, 30, "2 resets")
        until(lambda: all(f["to_go"] == 0 for f in republish(a)), 60, "A's objects all back")
    finally:
        looker.stop()
    assert [e["objects"] for e in keeper_events(a, "the master forgot this segment's objects")] == [128, 128]
    assert_loads(b, keys, expected)
    assert [(f["skipped"], f["failed"]) for f in republish(a)] == [(0, 0)] * 2
    assert written(a) == 0


def test_a_store_of_keys_being_put_back_writes_nothing_twice(daemons: DaemonFactory, mooncake: MooncakeMaster) -> None:
    """Acceptance 2: while A's keeper is putting back its prefix at a slow rate, A's engine stores the same prefix
    again: the keeper puts those objects back at once from its kept copies and the store writes none of them
    (A's ``objects`` stays 0); every object is put back once (64 a rank, none skipped) and loads byte for byte."""
    a, b = start_host(daemons, mooncake, extra=SLOW), start_host(daemons, mooncake)
    keys, expected = store_prefix(a, 64, salt=63)
    mooncake.stop()
    mooncake.start()
    midway(a, 64)
    assert store_prefix(a, 64, salt=63) == (keys, expected)  # the same blocks under the same keys
    assert written(a) == 0, "the store wrote objects the keeper was putting back"
    assert back(a, 64), republish(a)
    assert [(f["skipped"], f["failed"]) for f in republish(a)] == [(0, 0)] * 2
    assert_loads(b, keys, expected)


def test_status_metrics_and_logs_show_the_put_back(daemons: DaemonFactory, mooncake: MooncakeMaster) -> None:
    """Acceptance 3: A stores a 32-block prefix (64 objects) and loads its later half; its keeper puts back that
    half first, then 5 s later the earlier one; meanwhile `kvcached status` (JSON and table) and the metrics show each
    rank's objects and bytes to go and done and the rate. B stores the prefix's first 8 keys meanwhile, so A
    skips them (the master has them again); an object damaged in A's segment fails its check and is not put
    back. At the end: rank 0 put back 23, skipped 8, failed 1; rank 1 24, 8, 0; the daemon's log and the
    keeper's say when it began and when it was done, and how fast it went."""
    port = free_port()
    a = start_host(daemons, mooncake, extra=("--mooncake-republish-rate", "4KiB", "--metrics-port", str(port)))
    b = start_host(daemons, mooncake)
    keys, expected = store_prefix(a, 32, salt=64)
    assert load_prefix(a, keys[16:], first=32)[1] == 16  # its later half used last
    per_block = len(expected[0]) // 32
    damage(a, expected[0][20 * per_block : 21 * per_block])
    mooncake.stop()
    mooncake.start()
    midway(a, 32)
    during = republish(a)
    assert [(f["done"] + f["failed"], f["to_go"], f["to_go_bytes"]) for f in during] == [(16, 16, 16 * 640)] * 2
    assert all(f["rate_bytes_s"] > 0 for f in during), during
    table = render(read_status(a.instance))
    assert re.search(r"put back 1[56] \(.*\) skipped 0 failed [01] to go 16 \(10.0 KiB\) at [0-9.]+ [KM]iB/s", table), (
        table
    )
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    for name, value in [("republish_pending_objects", 16), ("republish_pending_bytes", 16 * 640)]:
        assert f'kvcached_store_{name}{{rank="1"}} {value}.0' in metrics, (name, metrics)
    assert 'kvcached_store_republished_objects_total{rank="1"} 16.0' in metrics, metrics
    assert re.search(r'kvcached_store_republish_rate_bytes\{rank="0"\} [1-9]', metrics), metrics
    store_prefix(b, 8, salt=64)  # the prefix's first 8 keys (other bytes): A's keeper finds them there
    until(lambda: all(f["to_go"] == 0 for f in republish(a)), 30, "A's put back done")
    after = [(f["done"], f["skipped"], f["failed"]) for f in republish(a)]
    assert after == [(23, 8, 1), (24, 8, 0)], after
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'kvcached_store_republish_skipped_total{rank="1"} 8.0' in metrics
    assert 'kvcached_store_republish_failed_total{rank="0"} 1.0' in metrics
    log = a.daemon.log()
    assert log.count("they are being put back") == 2, log
    assert log.count("the objects the store's master forgot are back") == 2, log
    (began,) = keeper_events(a, "the master forgot this segment's objects")
    until(lambda: keeper_events(a, "the objects the master forgot are back"), 30, "the round's end (its last pause)")
    (done,) = keeper_events(a, "the objects the master forgot are back")
    assert began["objects"] == 64 and (done["done"], done["skipped"], done["failed"]) == (47, 16, 1), done
    assert done["rate"] > 0 and keeper_events(a, "a kept object does not check")


def plain_client(master: MooncakeMaster, call: str, names: list[str]) -> Any:
    """What ``call`` (an expression of ``client`` and ``names``) gives in a plain Mooncake client of the master,
    a process that is no kvcached host (``names`` sent on its stdin)."""
    script = (
        "import json, socket, sys\n"
        "from mooncake.store import MooncakeDistributedStore\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "client = MooncakeDistributedStore()\n"
        "assert client.setup(f'127.0.0.1:{port}', sys.argv[1], 0, 16 << 20, 'tcp', '', sys.argv[2]) == 0\n"
        "names = json.loads(sys.stdin.read())\n"
        f"print(json.dumps({call}), flush=True)\n"
    )
    args = [sys.executable, "-c", script, master.metadata, master.address]
    done = subprocess.run(args, input=json.dumps(names), capture_output=True, text=True, timeout=60, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def replica_counts(master: MooncakeMaster, names: list[str]) -> list[int]:
    """How many memory replicas the master lists of each of ``names``."""
    found = "client.batch_get_replica_desc(names)"
    call = f"[sum(r.is_memory_replica() for r in found.get(n, ())) for found in [{found}] for n in names]"
    counts: list[int] = plain_client(master, call, names)
    return counts


def names_of(keys: list[bytes]) -> list[str]:
    digest = CacheSpec(**GEOMETRY, storage_backend="mooncake").geometry_digest.hex()
    return [f"kvcached/{digest}/{key.hex()}/r{rank}" for key in keys for rank in (0, 1)]


def test_with_replicas_each_host_puts_back_its_own_share_once(daemons: DaemonFactory, mooncake: MooncakeMaster) -> None:
    """Acceptance 4: three hosts with --mooncake-replicas 2 each store a 16-block prefix, a fourth stores one and
    is stopped for good; after the master's reset each of the three puts back its own 32 objects once (none
    skipped: no holder of a copy put it back too), every object is present once per replica (2), none lost, and
    loads byte for byte on another host; the stopped host's prefix stays gone (it put back nothing)."""
    hosts = [start_host(daemons, mooncake, replicas=2) for _ in range(3)]
    prefixes = [store_prefix(h, 16, salt=70 + i) for i, h in enumerate(hosts)]
    gone = start_host(daemons, mooncake, replicas=2)
    gone_keys, _ = store_prefix(gone, 16, salt=79)
    assert gone.daemon.stop() == 0
    mooncake.stop()
    mooncake.start()
    for host in hosts:
        until(lambda host=host: back(host, 16), 30, f"{host.instance}'s share put back")
    assert [[(f["done"], f["skipped"], f["failed"]) for f in republish(h)] for h in hosts] == [[(16, 0, 0)] * 2] * 3
    for keys, _ in prefixes:
        assert replica_counts(mooncake, names_of(keys)) == [2] * 32
    assert replica_counts(mooncake, names_of(gone_keys)) == [0] * 32
    for i, (keys, expected) in enumerate(prefixes):
        assert_loads(hosts[(i + 1) % 3], keys, expected)
    assert load_prefix(hosts[0], gone_keys)[:2] == (0, 0)


class _Quiet:
    def warning(self, *args: Any, **kwargs: Any) -> None:
        pass


class _NoSegment:
    """The republisher's keeper, for its index alone (nothing is put: no master is needed)."""

    log = _Quiet()


def test_the_index_costs_under_400_bytes_an_object_and_never_holds_more_than_the_segment() -> None:
    """docs/mooncake.md: the keeper's index of what its agents stored costs under 400 bytes an object (names
    included); it never holds more bytes than the segment (the least recently used go), and an object at an
    offset a newer one took is dropped."""
    index = Republisher(_NoSegment(), capacity=1000 * 655360, rate=1)  # type: ignore[arg-type]
    keys = [os.urandom(32) for _ in range(20_000)]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        names = [f"kvcached/{'ab' * 16}/{key.hex()}/r{i % 8}" for i, key in enumerate(keys)]  # as a request's
        index.stored({name: (i * 700_000, 655_360) for i, name in enumerate(names[:1000])}, 1)
        del names[1000:]
        after = tracemalloc.take_snapshot()
        names += [f"kvcached/{'ab' * 16}/{key.hex()}/r{i % 8}" for i, key in enumerate(keys[1000:], start=1000)]
    finally:
        tracemalloc.stop()
    per_object = sum(stat.size_diff for stat in after.compare_to(before, "filename")) / 1000
    print(f"\nthe keeper's index: {per_object:.0f} bytes an object")
    assert per_object < 400
    index.stored({name: (i * 700_000, 655_360) for i, name in enumerate(names[1000:], start=1000)}, 1)
    assert index.indexed() == names[-1000:], "more than the segment holds, or not the most recent"
    index.stored({names[0]: (19_999 * 700_000, 655_360)}, 1)  # where the most recent one lay
    assert names[-1] not in index.indexed() and index.indexed()[-1] == names[0]


def remove_objects(master: MooncakeMaster, names: list[str]) -> None:
    """Remove objects from the master's index, as any client can (their bytes stay)."""
    assert plain_client(master, "client.batch_remove(names, True)", names) == [0] * len(names)


def test_a_master_back_from_an_absence_missing_some_objects_gets_them_back(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """A master that comes back from an absence knowing only some of a host's objects (as one restored from an
    older snapshot would: here 8 of A's objects were removed from its index, then it answered nothing for 4 s):
    A's keeper finds which of its objects the master lacks and puts those back (8, none skipped), counted as a
    reset; B then loads the whole prefix byte for byte."""
    a, b = start_host(daemons, mooncake), start_host(daemons, mooncake)
    keys, expected = store_prefix(a, 16, salt=65)
    remove_objects(mooncake, names_of(keys[4:8]))
    assert load_prefix(b, keys)[:2] == (4, 4)
    assert mooncake.proc is not None
    halt(mooncake.proc.pid)
    time.sleep(4)
    os.kill(mooncake.proc.pid, signal.SIGCONT)
    until(lambda: sum(f["done"] for f in republish(a)) == 8, 30, "A's missing objects put back")
    assert [(f["done"], f["skipped"], f["failed"]) for f in republish(a)] == [(4, 0, 0)] * 2
    assert all(r["store"]["master_resets"] == 1 for r in read_status(a.instance)["ranks"])
    (event,) = keeper_events(a, "the Mooncake master forgot 8 objects of this segment")
    assert event["level"] == "warning"
    assert_loads(b, keys, expected)


def test_a_rate_of_0_puts_nothing_back(daemons: DaemonFactory, mooncake: MooncakeMaster) -> None:
    """With --mooncake-republish-rate 0 the keeper keeps and puts back nothing: after the master's restart the
    prefix stays a miss (no error), the reset is counted and every put back figure stays 0."""
    a = start_host(daemons, mooncake, extra=("--mooncake-republish-rate", "0"))
    keys, _ = store_prefix(a, 8, salt=66)
    mooncake.stop()
    mooncake.start()
    until(lambda: all(r["store"]["master_resets"] == 1 for r in read_status(a.instance)["ranks"]), 30, "the reset")
    until(lambda: all(availability(a.instance)), 30, "the store available again")
    time.sleep(2)  # (a put back would have begun by now)
    assert load_prefix(a, keys)[:2] == (0, 0)
    assert all(not any(f.values()) for f in republish(a)), republish(a)


NEIGHBOUR = """
import json, socket, sys
from mooncake.store import MooncakeDistributedStore
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
client = MooncakeDistributedStore()
assert client.setup(f"127.0.0.1:{port}", sys.argv[1], 16 << 20, 16 << 20, "tcp", "", sys.argv[2]) == 0
objects = json.loads(sys.stdin.read())
print(json.dumps([client.put(name, bytes.fromhex(data)) for name, data in objects.items()]), flush=True)
"""


def test_garbage_put_under_names_still_to_go_is_replaced_by_the_kept_copies_not_skipped(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """A plain Mooncake client of another uid puts random bytes under every name of A's prefix while A's keeper
    puts it back: an object the master has under a name still to go is read back and checked; garbage is
    removed and the kept copy put in its place, never counted skipped (A's copy let go), and B loads the whole
    prefix byte for byte."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the neighbour as another uid")
    a, b = start_host(daemons, mooncake, extra=SLOW), start_host(daemons, mooncake)
    keys, expected = store_prefix(a, 64, salt=900)
    mooncake.stop()
    mooncake.start()
    midway(a, 64)
    size = 640  # (the geometry's object: header and payload)
    garbage = json.dumps({name: os.urandom(size).hex() for name in names_of(keys)})
    neighbour = subprocess.run(
        [*AS_NEIGHBOUR, sys.executable, "-c", NEIGHBOUR, mooncake.metadata, mooncake.address],
        check=False,
        input=garbage,
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/tmp",
    )
    assert neighbour.returncode == 0, neighbour.stderr[-2000:]
    assert json.loads(neighbour.stdout.splitlines()[-1]).count(0) > 0  # some names were free to take
    until(lambda: all(f["to_go"] == 0 for f in republish(a)), 60, "A's put back done")
    assert [(f["done"], f["skipped"], f["failed"]) for f in republish(a)] == [(64, 0, 0)] * 2, republish(a)
    assert keeper_events(a, "an object the master has under a kept name does not check: replaced")
    assert_loads(b, keys, expected)


def test_a_master_restored_from_an_older_snapshot_gets_the_rest_back(
    daemons: DaemonFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mooncake's own snapshot and restore (``--enable_snapshot --enable_snapshot_restore``, a local snapshot
    store): host A stores prefix P1; a snapshot begins after that and is published; A stores prefix P2 before
    the next one begins; the master is killed -9 and started again, restoring that snapshot (P1, not P2). Host
    B then loads both prefixes whole and byte for byte: P1 as restored, P2 put back by A's keeper (exactly what
    the snapshot lacked), and A's engine stored nothing again."""
    pytest.importorskip("mooncake.store", reason="the mooncake extra is not installed")
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    monkeypatch.setenv("MOONCAKE_SNAPSHOT_LOCAL_PATH", str(snapshots))  # the local snapshot store's own variable
    flags = ["--enable_snapshot=true", "--snapshot_interval_seconds=5", "--snapshot_object_store_type=local"]
    master = MooncakeMaster(tmp_path / "mooncake_master.log", [*flags, "--enable_snapshot_restore=true"])
    latest = snapshots / "mooncake_master_snapshot" / "mooncake_cluster" / "latest.txt"

    def begun() -> list[str]:
        """The snapshots begun, as the master logs each when it forks the child that writes it."""
        return re.findall(r"Preparing to fork child process, snapshot_id=(\S+)", master.log.read_text(errors="replace"))

    def published(snapshot: str) -> bool:
        return latest.exists() and latest.read_text().strip() == snapshot

    master.start()
    try:
        a, b = start_host(daemons, master), start_host(daemons, master)
        p1_keys, p1 = store_prefix(a, 16, salt=70)
        after_p1 = len(begun())
        until(lambda: len(begun()) > after_p1 and published(begun()[-1]), 60, "a snapshot begun after P1, published")
        snapshots_before_p2 = begun()
        p2_keys, p2 = store_prefix(a, 16, salt=71)
        assert begun() == snapshots_before_p2, "a snapshot began while P2 was stored: what it holds is unknown"
        master.stop()
        master.start()
        assert f"restored state from snapshot: {snapshots_before_p2[-1]}" in master.log.read_text(errors="replace")

        def whole(keys: list[bytes]) -> bool:
            try:
                return load_prefix(b, keys)[:2] == (16, 16)
            except rc.StoreUnavailable:  # while the master takes connections again
                return False

        until(lambda: whole(p2_keys), 30, "P2 back")
        assert_loads(b, p1_keys, p1)
        assert_loads(b, p2_keys, p2)
        until(lambda: all(f["done"] + f["failed"] >= 16 for f in republish(a)), 10, "A's figures")
        assert [(f["done"], f["failed"], f["to_go"]) for f in republish(a)] == [(16, 0, 0)] * 2
        assert written(a) == 0, "A's engine stored again"
    finally:
        daemons.stop_all()
        master.stop()
