"""CPU swap tier: blocks move between device arena and CPU pool through the daemon, validated first."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import runner_client as rc
from kvcached.protocol.control import ControlBlock
from kvcached.protocol.messages import REQUEST, Op, Status, request
from kvcached.protocol.names import task_socket_path
from kvcached.status import read_status
from tests.conftest import Daemon, DaemonFactory, arena_digests, run_runner, runner_result
from tests.test_frames import read_reply

GEOMETRY: dict[str, Any] = dict(num_layers=3, kv_heads=2, head_dim=16, block_size=4, num_blocks=16, num_cpu_blocks=8)
FP8 = ["--num-layers", "3", "--num-blocks", "16", "--num-cpu-blocks", "8", "--dtype", "int8", "--block-wise-fp8"]


def spec_fp8() -> rc.CacheSpec:
    return rc.CacheSpec(**GEOMETRY, dtype="int8", block_wise_fp8=True)


def tensors(cache: rc.KVCache) -> list[np.ndarray]:
    return cache.key_caches + cache.value_caches + cache.key_cache_scales + cache.value_cache_scales


def fill_random(cache: rc.KVCache, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for t in tensors(cache):
        raw = t.view(np.uint8)
        raw[...] = rng.integers(0, 256, raw.shape, dtype=np.uint8)


def blocks_of(cache: rc.KVCache, ids: list[int]) -> list[bytes]:
    return [t[i].tobytes() for t in tensors(cache) for i in ids]


@pytest.fixture
def fp8_daemon(daemons: DaemonFactory) -> Iterator[Daemon]:
    daemon = daemons.start(ranks=2, args=FP8)
    daemon.wait_ready()
    yield daemon


def test_round_trip_all_layers_keys_values_scales(fp8_daemon: Daemon) -> None:
    """Random blocks swapped out, overwritten, swapped in to other device ids: byte-equal, on both ranks."""
    instance = fp8_daemon.instance
    caches = [rc.initialize_kv_cache(spec_fp8(), r, instance=instance) for r in (0, 1)]
    try:
        for rank, cache in enumerate(caches):
            fill_random(cache, seed=rank)
        src, cpu, dst = [1, 2, 3, 9, 15], [0, 1, 2, 7, 4], [4, 5, 6, 0, 10]
        before = [blocks_of(c, src) for c in caches]
        untouched = [blocks_of(c, [7, 8]) for c in caches]
        with rc.CacheTasks(instance) as tasks:
            result = tasks.swap_out(None, src, cpu)
            assert result.ranks == (0, 1) and result.blocks == 5 and result.bytes == 5 * spec_fp8().block_bytes
            for cache in caches:
                for t in tensors(cache):
                    t[src] = 0
            tasks.swap_in(None, cpu, dst)
        for rank, cache in enumerate(caches):
            assert blocks_of(cache, dst) == before[rank]
            assert blocks_of(cache, [7, 8]) == untouched[rank], "blocks outside the task are untouched"
        assert len(tensors(caches[0])) == 3 * 4  # keys, values and both scales of every layer were compared
    finally:
        for cache in caches:
            cache.close()


def test_round_trip_mla_and_single_rank(daemons: DaemonFactory) -> None:
    """MLA (key cache only): a swap on one rank moves that rank's blocks only."""
    daemon = daemons.start(ranks=2, args=["--mla", "--num-blocks", "16", "--num-cpu-blocks", "8"])
    daemon.wait_ready()
    spec = rc.CacheSpec(**{**GEOMETRY, "num_layers": 2}, mla=True)
    caches = [rc.initialize_kv_cache(spec, r, instance=daemon.instance) for r in (0, 1)]
    try:
        for rank, cache in enumerate(caches):
            fill_random(cache, seed=10 + rank)
        other = blocks_of(caches[0], list(range(16)))
        expected = blocks_of(caches[1], [3])
        with rc.CacheTasks(daemon.instance) as tasks:
            tasks.swap_out(1, [3], [5])
            tasks.swap_in(1, [5], [12])
        assert blocks_of(caches[1], [12]) == expected
        assert blocks_of(caches[0], list(range(16))) == other
    finally:
        for cache in caches:
            cache.close()


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (("swap_out", 0, [16], [0]), "device_block_ids"),
        (("swap_out", 0, [0], [8]), "cpu_block_ids"),
        (("swap_in", None, [-1], [0]), "cpu_block_ids"),
        (("swap_in", 1, [0], [99]), "device_block_ids"),
        (("swap_out", None, [1, 2], [3, 3]), "cpu_block_ids"),
        (("swap_in", 0, [1, 2], [5, 5]), "device_block_ids"),
        (("swap_out", 0, [1, 2, 3], [1, 2]), "cpu_block_ids"),
        (("swap_in", 0, [1, 2], [1, 2, 3]), "device_block_ids"),
        (("swap_out", 2, [1], [1]), "rank"),
        (("swap_out", -1, [1], [1]), "rank"),
        (("swap_out", 0, [1.5], [1]), "device_block_ids"),
        (("swap_out", 0, [[1, 2]], [1]), "device_block_ids"),
        (("swap_in", 0, [2**40], [1]), "cpu_block_ids"),
    ],
)
def test_bad_task_refused_and_nothing_changes(fp8_daemon: Daemon, call: tuple[Any, ...], field: str) -> None:
    """Each bad task raises InvalidTask naming the field; every arena and pool is unchanged; the daemon then
    serves a valid task."""
    instance = fp8_daemon.instance
    with rc.initialize_kv_cache(spec_fp8(), 0, instance=instance) as cache:
        fill_random(cache, seed=3)
        with rc.CacheTasks(instance) as tasks:
            tasks.swap_out(None, list(range(8)), list(range(8)))  # fill the pools too
            before = arena_digests(instance)
            method, rank, a, b = call
            with pytest.raises(rc.InvalidTask) as info:
                getattr(tasks, method)(rank, a, b)
            assert info.value.field == field, info.value
            if len(a) != len(b):  # the message names both of the call's lists
                assert "device_block_ids" in info.value.message and "cpu_block_ids" in info.value.message, info.value
            assert arena_digests(instance) == before
            expected = blocks_of(cache, [6])
            tasks.swap_out(0, [6], [1])
            tasks.swap_in(0, [1], [13])
            assert blocks_of(cache, [13]) == expected


def test_rank_not_ready_is_refused(daemons: DaemonFactory) -> None:
    """A task for a rank that is still ALLOCATING is refused, naming the rank and its state."""
    daemon = daemons.start(ranks=1, env=daemons.env(KVCACHED_FAULT="worker-before-ready:sleep=60"))
    daemon.wait_state("ALLOCATING")
    with rc.CacheTasks(daemon.instance) as tasks, pytest.raises(rc.InvalidTask, match="ALLOCATING, not READY") as info:
        tasks.swap_out(0, [1], [1])
    assert info.value.field == "rank"


def test_no_cpu_pool_is_refused(daemons: DaemonFactory) -> None:
    """An instance without a CPU pool (daemon-owned through its role) refuses swaps, saying why."""
    daemon = daemons.start(ranks=1, args=["--num-cpu-blocks", "0", "--role", "decode"])
    daemon.wait_ready()
    with rc.CacheTasks(daemon.instance) as tasks, pytest.raises(rc.InvalidTask, match="no CPU swap pool"):
        tasks.swap_out(0, [1], [0])


def test_garbage_and_disconnects_do_not_hurt_the_daemon(fp8_daemon: Daemon) -> None:
    """Random bytes, a truncated frame, an oversized frame, a task without HELLO, and a client that leaves
    mid-task: the rank keeps serving and no block changed."""
    instance = fp8_daemon.instance
    # A real task whose client vanishes before the reply: it completes, the rank serves on.
    tasks = rc.CacheTasks(instance)
    tasks.submit(tasks.swap_out, 0, list(range(8)), list(range(8)))
    tasks.close()
    with rc.CacheTasks(instance) as barrier:
        barrier.swap_out(0, [], [])  # the worker is single-threaded: the earlier task is done
    before = arena_digests(instance)
    path = str(task_socket_path(read_status_run_dir(instance), instance, 0))
    rng = np.random.default_rng(7)
    frames = [
        rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(),
        request(Op.SWAP_OUT, 1, b"\x01\x00")[: REQUEST.size + 1],
        struct.pack("<4sHHQI", b"KVT1", Op.SWAP_OUT, 0, 1, 1 << 30),
        request(Op.SWAP_OUT, 1, np.array([1, 2], dtype="<i4").tobytes()),
        request(Op.HELLO, 1, b"not json"),
    ]
    for frame in frames:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)
            s.sendall(frame)
            s.settimeout(2)  # the truncated frame is never answered: the worker waits for its rest
            with contextlib.suppress(TimeoutError, ConnectionResetError):
                s.recv(4096)
    assert arena_digests(instance) == before
    assert fp8_daemon.proc.poll() is None
    with rc.CacheTasks(instance) as fresh:
        assert fresh.swap_out(None, [1], [1]).blocks == 1
    assert read_status(instance)["ranks"][0]["swap"]["tasks_refused"] >= 4


def test_a_hello_nested_past_the_stack_or_for_another_daemon_is_refused(fp8_daemon: Daemon) -> None:
    """A HELLO whose JSON nests past the parser's stack is INVALID (field ``hello``), not a failed task with a
    traceback in the log that any client of the uid could fill; a HELLO that expects another daemon, even
    after a good one, is INVALID and leaves the connection unable to send tasks until a good HELLO."""
    instance = fp8_daemon.instance
    generation = read_status(instance)["generation"]
    path = str(task_socket_path(read_status_run_dir(instance), instance, 0))
    hello = json.dumps({"generation": generation}).encode()
    swap = request(Op.SWAP_OUT, 4, np.array([1, 1], dtype="<i4").tobytes())
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(request(Op.HELLO, 1, b"[" * 100_000))
        _, status, _, body = read_reply(s)
        assert (status, json.loads(body)["field"]) == (Status.INVALID, "hello"), body
        for frame in (request(Op.HELLO, 2, hello), swap, request(Op.HELLO, 3, b'{"generation": "0"}'), swap):
            s.sendall(frame)
        replies = [read_reply(s) for _ in range(4)]
        assert [r[1] for r in replies] == [Status.OK, Status.OK, Status.INVALID, Status.INVALID], replies
        assert json.loads(replies[3][3])["field"] == "hello", "a task after a HELLO for another daemon"
    assert "RecursionError" not in fp8_daemon.log() and "task failed" not in fp8_daemon.log()
    assert fp8_daemon.proc.poll() is None


def read_status_run_dir(instance: str) -> str:
    block = ControlBlock.open(instance)
    assert block is not None
    try:
        return block.header().run_dir
    finally:
        block.close()


def test_two_runner_processes_swap_concurrently(fp8_daemon: Daemon, daemons: DaemonFactory) -> None:
    """Two runner processes, each swapping random blocks of its own rank many times at once: all correct."""
    env = daemons.env()
    spec = spec_fp8().to_dict()
    runners = [run_runner(env, spec=spec, rank=r, instance=fp8_daemon.instance, swap_rounds=60) for r in (0, 1)]
    results = [runner_result(r, timeout=120) for r in runners]
    assert all(r["ok"] and r["swap_ok"] for r in results), results
    swaps = [r["swap"] for r in read_status(fp8_daemon.instance)["ranks"]]
    assert all(s["swap_out_tasks"] == 60 and s["swap_in_tasks"] == 60 for s in swaps)


def test_handle_result_and_status_counters(fp8_daemon: Daemon, daemons: DaemonFactory) -> None:
    """submit returns a handle; status shows the pool size and the swap counters per rank."""
    instance = fp8_daemon.instance
    with rc.CacheTasks(instance) as tasks:
        handles = [tasks.submit(tasks.swap_out, None, [i], [i]) for i in range(4)]
        results = [h.result(timeout=10) for h in reversed(handles)]
        assert [r.blocks for r in results] == [1, 1, 1, 1]
    status = read_status(instance)
    for r in status["ranks"]:
        assert r["cpu_blocks"] == 8
        assert r["swap"]["swap_out_tasks"] == 4 and r["swap"]["swap_out_blocks"] == 4
        assert r["swap"]["swap_out_bytes"] == 4 * spec_fp8().block_bytes
        assert r["latency"]["swap_out"]["count"] == 4 and r["latency"]["swap_out"]["p50_s"] is not None
        assert r["latency"]["swap_in"] == {"count": 0, "p50_s": None, "p99_s": None}
    table = daemons.cli("status", "--instance", instance).stdout
    assert "(8 blocks)" in table and "4 (4 blk" in table and "p50 <= " in table


def test_submit_takes_only_task_methods_and_wait_is_gone(fp8_daemon: Daemon) -> None:
    """``submit`` takes only this client's swap_out, swap_in, store and load, and sends nothing when refused;
    the task methods take no ``wait=`` any more (removed: ``submit`` returns a handle); the plain calls warn
    about nothing."""
    with rc.CacheTasks(fp8_daemon.instance) as tasks, rc.CacheTasks(fp8_daemon.instance) as other:
        with pytest.raises(TypeError, match="wait"):
            tasks.swap_out(0, [1], [1], wait=False)  # type: ignore[call-arg]
        for task, args in ((tasks.lookup, ([b"k" * 32],)), (other.swap_out, (0, [1], [1])), (print, ())):
            with pytest.raises(rc.InvalidArgument) as info:
                tasks.submit(task, *args)  # type: ignore[arg-type]
            assert info.value.field == "task"
        refused = tasks.submit(tasks.swap_out, 0, [999], [0])  # the daemon checks ids: its refusal is the result
        with pytest.raises(rc.InvalidTask) as info:
            refused.result(timeout=10)
        assert info.value.field == "device_block_ids", info.value
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert tasks.submit(tasks.swap_out, 0, [3], [3]).result(timeout=10).blocks == 1
            assert tasks.swap_in(0, [3], [4]).blocks == 1
    swaps = [r["swap"] for r in read_status(fp8_daemon.instance)["ranks"]]
    assert swaps[0]["swap_out_tasks"] == 1 and swaps[0]["swap_in_tasks"] == 1  # the refused one counts nowhere


def test_a_timeout_that_is_not_a_time_or_keys_that_are_not_keys_are_refused_before_anything_is_sent(
    fp8_daemon: Daemon,
) -> None:
    """A task timeout of inf, 1e12 (past what a wait can count), nan, 0, a bool or a string raises
    InvalidArgument naming ``timeout`` and sends nothing (an inf once moved the blocks, then raised an
    OverflowError); so does one given to the client or to ``result``; keys that are not a list raise
    InvalidTask naming ``keys``. A result looked at with timeout 0 polls."""
    with rc.CacheTasks(fp8_daemon.instance, timeout=10) as tasks:
        for timeout in (float("inf"), 1e12, float("nan"), 0, -1, True, "1"):
            with pytest.raises(rc.InvalidArgument) as info:
                tasks.swap_in(0, [1], [1], timeout=timeout)  # type: ignore[arg-type]
            assert info.value.field == "timeout"
            if timeout not in (0, -1):
                with pytest.raises(rc.InvalidArgument):
                    rc.CacheTasks(fp8_daemon.instance, timeout=timeout)  # type: ignore[arg-type]
        handle = tasks.submit(tasks.swap_out, 0, [1], [1])
        with pytest.raises(rc.InvalidArgument):
            handle.result(timeout=float("inf"))
        assert handle.result(timeout=10).blocks == 1 and handle.result(timeout=0).blocks == 1
        for keys in (5, None):
            with pytest.raises(rc.InvalidTask) as task_info:
                tasks.lookup(keys)  # type: ignore[arg-type]
            assert task_info.value.field == "keys"
    swap = read_status(fp8_daemon.instance)["ranks"][0]["swap"]
    assert (swap["swap_in_tasks"], swap["swap_out_tasks"]) == (0, 1), swap


def test_daemon_gone_during_tasks(daemons: DaemonFactory) -> None:
    """A task after the daemon was killed raises DaemonGone (TaskLost if its worker was still there to take
    it: it died during the task), not a hang or a bare socket error, once no daemon took over in time."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    tasks = rc.CacheTasks(daemon.instance)
    tasks.swap_out(0, [1], [1])
    daemon.kill9()
    with pytest.raises((rc.DaemonGone, rc.TaskLost)):
        tasks.swap_out(0, [1], [1], timeout=2)
    started = time.monotonic()
    with pytest.raises(rc.DaemonGone, match="no daemon took its memory over within"):
        tasks.swap_out(0, [1], [1], timeout=2)
    assert time.monotonic() - started < 10
    tasks.close()
    daemons.start(daemon.instance, ranks=1).wait_ready()  # reclaims the killed run's objects
    assert os.path.exists(f"/dev/shm/kvcached.{daemon.instance}")


def test_a_stop_under_a_stream_of_swaps_is_daemon_gone_never_the_callers_mistake(daemons: DaemonFactory) -> None:
    """`kvcached stop` while a thread swaps: a task cut off raises TaskLost saying the daemon stops, every
    later one DaemonGone saying so; never InvalidTask (it was "rank 0 is STOPPING, not READY", as if the
    caller had erred)."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    errors: list[Exception] = []
    done = threading.Event()
    with rc.CacheTasks(daemon.instance, timeout=10) as tasks:

        def swapping() -> None:
            while len(errors) < 20:
                try:
                    tasks.swap_out(0, [1, 2], [1, 2])
                    done.set()
                except rc.KVCacheError as exc:
                    errors.append(exc)

        thread = threading.Thread(target=swapping)
        thread.start()
        assert done.wait(20), "no swap went through"
        daemons.cli("stop", "--instance", daemon.instance)
        thread.join(60)
        assert not thread.is_alive(), "the tasks after the stop hung"
    assert all(isinstance(exc, (rc.TaskLost, rc.DaemonGone)) for exc in errors), errors
    assert isinstance(errors[-1], rc.DaemonGone), errors[-1]
    for exc in errors:
        assert "stop" in str(exc) or "is gone" in str(exc), exc


def test_workers_run_with_streaming_store_tunables_on_the_numpy_path(daemons: DaemonFactory) -> None:
    """Without the native copy routine the daemon re-execs itself (same pid) with the streaming-store
    tunables, which its forked rank workers inherit; with it (it streams by itself) there is no exec.
    (/proc/<pid>/environ cannot show it: glibc splits that string in place while parsing it.)"""
    import json

    from kvcached import native
    from kvcached.cli import STREAMING_TUNABLES

    def starting(daemon: Daemon) -> dict[str, str]:
        daemon.wait_ready()
        assert read_status(daemon.instance)["pid"] == daemon.pid
        return next(json.loads(line) for line in daemon.log().splitlines() if '"starting"' in line)

    env = daemons.env(KVCACHED_NATIVE_COPY="0")
    env.pop("GLIBC_TUNABLES", None)
    numpy_path = starting(daemons.start(ranks=1, env=env))
    for name, value in STREAMING_TUNABLES.items():
        assert f"{name}={value}" in numpy_path["glibc_tunables"]
    if not native.available():
        pytest.skip("the native copy routine is not built here")
    env = daemons.env()
    env.pop("GLIBC_TUNABLES", None)
    native_path = starting(daemons.start(ranks=1, env=env))
    assert native_path["glibc_tunables"] == "" and "native" in native_path["copy_engine"]
