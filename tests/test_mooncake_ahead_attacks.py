"""Loads looked up ahead (``Store.expect``) under a hostile neighbour, through a real ``mooncake_master``:
several clients pipelining loads on the same ranks while another stores and looks up, garbage frames right
behind a load on a raw connection, the keeper killed (``kill -9``) and the master restarted while loads
are queued. Each load reports only blocks that are its keys' bytes, a miss is a miss, every reply is its
own task's, and the daemon outlives its clients' input."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np

import runner_client as rc
from kvcached.protocol.messages import MAX_PAYLOAD, REQUEST, REQUEST_MAGIC, TASK_RESULT, Op, Status, request
from kvcached.protocol.names import task_socket_path
from kvcached.status import read_status
from tests.conftest import DaemonFactory, MooncakeMaster
from tests.helpers.procs import halt
from tests.test_frames import read_reply
from tests.test_mooncake_ahead import FLAGS, PER_LOAD, attached, blocks, fill, keys_for, start
from tests.test_mooncake_hosts import alive, until


def test_clients_pipelining_loads_on_the_same_ranks_each_get_their_own_blocks(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Three clients each send four loads at once (a whole prefix, a prefix that runs out, a prefix another
    client loads too, a whole prefix again), five rounds, while a fourth client stores new keys and looks
    keys up: every load reports its own count and lands its own keys' bytes; every lookup and store gets its
    own answer."""
    daemon = start(daemons, mooncake)
    prefixes = [keys_for(PER_LOAD, salt=1_000 * (p + 1)) for p in range(3)]
    source = [list(range(p * PER_LOAD, (p + 1) * PER_LOAD)) for p in range(3)]
    errors: list[str] = []
    with attached(daemon.instance) as caches, rc.CacheTasks(daemon.instance) as setup:
        for p in range(3):
            fill(caches, source[p], seed=p + 10)
            assert setup.store(None, source[p], prefixes[p]).blocks == PER_LOAD
        expected = [blocks(caches, ids) for ids in source]

        def pipelined(c: int) -> None:
            base = 120 + c * 40
            with rc.CacheTasks(daemon.instance) as tasks:
                for round_ in range(5):
                    which = (c + round_) % 3
                    targets = list(range(base, base + PER_LOAD))
                    handles = [
                        tasks.submit(tasks.load, None, prefixes[which][:half], targets[:half])
                        for half in (PER_LOAD, 33, PER_LOAD)
                    ]
                    counts = [h.result().blocks for h in handles]
                    if counts != [PER_LOAD, 33, PER_LOAD]:
                        errors.append(f"client {c} round {round_}: loads reported {counts}")
                    if blocks(caches, targets) != expected[which]:
                        errors.append(f"client {c} round {round_}: landed bytes are not prefix {which}'s")

        def neighbour() -> None:
            with rc.CacheTasks(daemon.instance) as tasks:
                for n in range(15):
                    own = keys_for(2, salt=50_000 + 10 * n)
                    if tasks.lookup(own) != 0:
                        errors.append(f"neighbour {n}: a lookup of unstored keys found some")
                    if tasks.store(None, [250 + n % 4, 251 + n % 4], own).blocks != 2:
                        errors.append(f"neighbour {n}: a store of 2 new keys did not write 2")
                    if tasks.lookup(prefixes[n % 3]) != PER_LOAD:
                        errors.append(f"neighbour {n}: a lookup of a stored prefix was not {PER_LOAD}")

        threads = [threading.Thread(target=pipelined, args=(c,)) for c in range(3)]
        threads.append(threading.Thread(target=neighbour))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        assert not any(t.is_alive() for t in threads), "a client hung"
        assert not errors, errors
    assert all(rank["store"]["corrupt"] == 0 for rank in read_status(daemon.instance)["ranks"])
    assert daemon.proc.poll() is None
    assert "first window located ahead" in daemon.log()


def _raw(daemon: Any, daemons: DaemonFactory, rank: int) -> socket.socket:
    status = read_status(daemon.instance)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(str(task_socket_path(daemons.run_dir, daemon.instance, rank)))
    sock.sendall(request(Op.HELLO, 1, json.dumps({"generation": status["generation"]}).encode()))
    op, code, _, body = read_reply(sock)
    assert (op, code) == (Op.HELLO, Status.OK), body
    return sock


def test_garbage_right_behind_a_load_costs_only_that_connection(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """On a raw connection to rank 0, a whole LOAD followed in the same write by: a partial LOAD, a frame of
    wrong magic, a header announcing a giant payload, a LOAD whose payload is not ids and keys (and a LOAD
    of keys that were never stored, right behind a load). The load is answered with its own count, the
    garbage at worst closes that connection, the daemon and its workers stay, and another client's load
    and lookup get their own answers."""
    daemon = start(daemons, mooncake)
    keys = keys_for(PER_LOAD, salt=0)
    ids = list(range(PER_LOAD))
    with attached(daemon.instance) as caches, rc.CacheTasks(daemon.instance) as tasks:
        fill(caches, ids, seed=1)
        expected = blocks(caches, ids)
        assert tasks.store(None, ids, keys).blocks == PER_LOAD
        workers = [r["pid"] for r in read_status(daemon.instance)["ranks"]]
        target = np.arange(100, 100 + PER_LOAD, dtype="<i4").tobytes()
        load = request(Op.LOAD, 2, target + b"".join(keys))
        never = keys_for(PER_LOAD, salt=77_000)
        garbage = [
            request(Op.LOAD, 3, target + b"".join(keys))[:-5],
            b"XXXX" + request(Op.LOAD, 3, target + b"".join(keys))[4:],
            REQUEST.pack(REQUEST_MAGIC, Op.LOAD, 0, 3, MAX_PAYLOAD),
            request(Op.LOAD, 3, os.urandom(4 + 16) * 8),
            request(Op.LOAD, 3, target + b"".join(never)),
        ]
        for n, tail in enumerate(garbage):
            sock = _raw(daemon, daemons, 0)
            try:
                sock.sendall(load + tail)
                op, code, task_id, body = read_reply(sock)
                assert (op, code, task_id) == (Op.LOAD, Status.OK, 2), (n, body)
                assert TASK_RESULT.unpack(body)[:2] == (PER_LOAD, PER_LOAD * caches[0].spec.block_bytes), (n, body)
                if n < 4:  # nothing after the load lands in its blocks (the last garbage is a load of misses)
                    assert blocks(caches[:1], list(range(100, 100 + PER_LOAD))) == blocks(caches[:1], ids), n
            finally:
                sock.close()
            assert tasks.load(None, keys, list(range(150, 150 + PER_LOAD))).blocks == PER_LOAD, n
            assert blocks(caches, list(range(150, 150 + PER_LOAD))) == expected, n
            assert tasks.lookup(keys) == PER_LOAD and tasks.lookup(never) == 0, n
        assert [r["pid"] for r in read_status(daemon.instance)["ranks"]] == workers
    assert daemon.proc.poll() is None


def serves_again(tasks: rc.CacheTasks, caches: list[rc.KVCache]) -> None:
    """Once the store answers again (within 60 s), four fresh blocks are stored and load back byte for byte."""
    fresh = keys_for(4, salt=60_000)
    for _ in range(60):
        try:
            if tasks.store(None, [240, 241, 242, 243], fresh).blocks == 4:
                break
        except rc.StoreUnavailable:
            pass
        threading.Event().wait(1.0)
    assert tasks.load(None, fresh, [244, 245, 246, 247]).blocks == 4
    assert blocks(caches, [244, 245, 246, 247]) == blocks(caches, [240, 241, 242, 243])


def _keeper(daemon: Any, daemons: DaemonFactory) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(str(daemons.run_dir / f"{daemon.instance}.mooncake.sock"))
        pid: int = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        return pid


def test_a_keeper_killed_under_queued_loads_costs_loads_never_a_wrong_block(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Twelve loads queued on both ranks; the keeper is killed (-9) once the first is answered. Every load
    answered OK reports blocks that are its keys' bytes (the objects went with the keeper: later ones are
    misses or StoreUnavailable); the daemon's workers stay; once a new keeper runs, a store and a load of
    new keys work, and lookups of the old keys are misses."""
    daemon = start(daemons, mooncake)
    keys = keys_for(PER_LOAD, salt=0)
    ids = list(range(PER_LOAD))
    with attached(daemon.instance) as caches, rc.CacheTasks(daemon.instance, timeout=60) as tasks:
        fill(caches, ids, seed=1)
        assert tasks.store(None, ids, keys).blocks == PER_LOAD
        keeper = _keeper(daemon, daemons)
        workers = [r["pid"] for r in read_status(daemon.instance)["ranks"]]
        targets = [list(range(100 + 50 * (k % 3), 100 + 50 * (k % 3) + PER_LOAD)) for k in range(12)]
        handles = [tasks.submit(tasks.load, None, keys, targets[k]) for k in range(12)]
        outcomes: list[Any] = []
        for k, handle in enumerate(handles):
            try:
                got = handle.result().blocks
                outcomes.append(got)
                landed = blocks(caches, targets[k][:got])
                assert landed == blocks(caches, ids[:got]), f"load {k} reported {got} blocks not its keys' bytes"
            except rc.KVCacheError as exc:
                outcomes.append(type(exc).__name__)
            if k == 0:
                os.kill(keeper, signal.SIGKILL)
        assert outcomes[0] == PER_LOAD, outcomes
        until(lambda: not alive(keeper), 30, "the killed keeper gone")  # torn down, not only signalled
        assert [r["pid"] for r in read_status(daemon.instance)["ranks"]] == workers, outcomes
        serves_again(tasks, caches)
        assert tasks.lookup(keys) in (0, PER_LOAD)
    assert daemon.proc.poll() is None


def test_a_damaged_object_in_a_window_located_ahead_is_a_miss(daemons: DaemonFactory, mooncake: MooncakeMaster) -> None:
    """Rank 0's third object of the next load is changed in place in the keeper's segment; the next load's
    first window is located ahead while the one before it lands: that load reports 2 blocks (each its keys'
    bytes), the damaged object is counted and removed, and the load after it and a lookup get their own
    answers."""
    daemon = start(daemons, mooncake)
    first, second = keys_for(PER_LOAD, salt=0), keys_for(PER_LOAD, salt=40_000)
    with attached(daemon.instance) as caches, rc.CacheTasks(daemon.instance) as tasks:
        fill(caches, list(range(2 * PER_LOAD)), seed=3)
        assert tasks.store(None, list(range(PER_LOAD)), first).blocks == PER_LOAD
        assert tasks.store(None, list(range(PER_LOAD, 2 * PER_LOAD)), second).blocks == PER_LOAD
        keeper = _keeper(daemon, daemons)
        segment = next(
            f"/proc/{keeper}/fd/{fd}"
            for fd in os.listdir(f"/proc/{keeper}/fd")
            if "memfd:kvcached-mooncake" in os.readlink(f"/proc/{keeper}/fd/{fd}")
        )
        third = caches[0].key_caches[0][PER_LOAD + 2].tobytes()[:128]
        with open(segment, "r+b") as f:
            data = f.read()
            where = data.find(third)
            assert where > 0
            f.seek(where + 64)
            f.write(bytes(b ^ 0xFF for b in data[where + 64 : where + 72]))
        handles = [
            tasks.submit(tasks.load, None, first, list(range(100, 100 + PER_LOAD))),
            tasks.submit(tasks.load, None, second, list(range(150, 150 + PER_LOAD))),
            tasks.submit(tasks.load, None, first, list(range(200, 200 + PER_LOAD))),
        ]
        assert [h.result().blocks for h in handles] == [PER_LOAD, 2, PER_LOAD]
        assert blocks(caches, list(range(150, 152))) == blocks(caches, [PER_LOAD, PER_LOAD + 1])
        assert blocks(caches, list(range(200, 200 + PER_LOAD))) == blocks(caches, list(range(PER_LOAD)))
        assert tasks.lookup(second) == 2 and tasks.lookup(first) == PER_LOAD
    assert read_status(daemon.instance)["ranks"][0]["store"]["corrupt"] == 1
    assert "first window located ahead" in daemon.log()


def test_a_master_restarted_under_queued_loads_costs_misses_never_a_wrong_block(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Twelve loads queued on both ranks while the master is down (killed -9, started again 1 s later: it
    forgets every object). Each load answered OK reports only its keys' bytes; the rest fail as
    unavailable or miss; the workers stay; then a store and a load of new keys work and get their own
    answers."""
    daemon = start(daemons, mooncake)
    keys = keys_for(PER_LOAD, salt=0)
    ids = list(range(PER_LOAD))
    with attached(daemon.instance) as caches, rc.CacheTasks(daemon.instance, timeout=60) as tasks:
        fill(caches, ids, seed=1)
        assert tasks.store(None, ids, keys).blocks == PER_LOAD
        workers = [r["pid"] for r in read_status(daemon.instance)["ranks"]]
        targets = [list(range(100 + 50 * (k % 3), 100 + 50 * (k % 3) + PER_LOAD)) for k in range(12)]
        assert tasks.load(None, keys, targets[0]).blocks == PER_LOAD
        mooncake.stop()
        restart = threading.Timer(1.0, mooncake.start)
        restart.start()
        handles = [tasks.submit(tasks.load, None, keys, targets[k]) for k in range(12)]
        outcomes: list[Any] = []
        for k, handle in enumerate(handles):
            try:
                got = handle.result().blocks
                outcomes.append(got)
                assert blocks(caches, targets[k][:got]) == blocks(caches, ids[:got]), k
            except rc.KVCacheError as exc:
                outcomes.append(type(exc).__name__)
        restart.join()
        assert [r["pid"] for r in read_status(daemon.instance)["ranks"]] == workers, outcomes
        serves_again(tasks, caches)
        assert tasks.lookup(keys_for(4, salt=61_000)) == 0
    assert daemon.proc.poll() is None


def test_a_store_agent_stopped_under_queued_loads_costs_those_loads(
    daemons: DaemonFactory, mooncake: MooncakeMaster
) -> None:
    """Rank 0's store agent is stopped (SIGSTOP), then eight loads are queued: those it had fail within the
    store timeout (2 s) or are served by the next agent, never with a wrong block;
    the worker stays; then loads and lookups get their own answers, byte for byte."""
    daemon = daemons.start(ranks=2, args=[*FLAGS, *mooncake.args(), "--store-timeout", "2"])
    daemon.wait_ready()
    keys = keys_for(PER_LOAD, salt=0)
    ids = list(range(PER_LOAD))
    with attached(daemon.instance) as caches, rc.CacheTasks(daemon.instance, timeout=60) as tasks:
        fill(caches, ids, seed=1)
        assert tasks.store(None, ids, keys).blocks == PER_LOAD
        worker = read_status(daemon.instance)["ranks"][0]["pid"]
        agent = int(Path(f"/proc/{worker}/task/{worker}/children").read_text().split()[0])
        targets = [list(range(100 + 50 * (k % 3), 100 + 50 * (k % 3) + PER_LOAD)) for k in range(8)]
        assert tasks.load(None, keys, targets[0]).blocks == PER_LOAD
        halt(agent)
        handles = [tasks.submit(tasks.load, None, keys, targets[k]) for k in range(8)]
        outcomes: list[Any] = []
        try:
            for k, handle in enumerate(handles):
                try:
                    got = handle.result().blocks
                    outcomes.append(got)
                    assert blocks(caches, targets[k][:got]) == blocks(caches, ids[:got]), k
                except rc.KVCacheError as exc:
                    outcomes.append(type(exc).__name__)
        finally:
            if alive(agent):
                os.kill(agent, signal.SIGCONT)
        assert read_status(daemon.instance)["ranks"][0]["pid"] == worker
        for _ in range(60):
            try:
                if tasks.load(None, keys, list(range(200, 200 + PER_LOAD))).blocks == PER_LOAD:
                    break
            except rc.StoreUnavailable:
                pass
            threading.Event().wait(1.0)
        assert blocks(caches, list(range(200, 200 + PER_LOAD))) == blocks(caches, ids)
        assert tasks.lookup(keys) == PER_LOAD and tasks.lookup(keys_for(4, salt=61_000)) == 0
    assert daemon.proc.poll() is None
