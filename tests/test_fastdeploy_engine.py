"""FastDeploy's engine served by the kvcached drop-in: one copy of the cache, the transfer queue spoken.

This test plays FastDeploy's engine as ``PrefixCacheManager.launch_cache_manager`` does it (e53f5184,
``cache_manager/prefix_cache_manager.py`` ~178-345, and the signals and queue server of
``engine/common_engine.py`` ~360-486): it creates the flags and the cache queue server, launches one drop-in
per rank with ``cache_transfer_manager.py``'s arguments, waits for ``cache_transfer_inited_signal``, issues
SWAP2CPU and SWAP2GPU tasks, a storage write and read, and control requests, reading the results the way
``recv_data_transfer_result`` does (~2140-2199); the bytes in the device blocks are checked after each step
through a runner's own views. With ``FASTDEPLOY_SRC`` set the queue, the flags, ``CacheStatus`` and the
storage tasks are FastDeploy's own files; without it, the doubles of ``tests/helpers/fastdeploy_double.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import runner_client as rc
from kvcached.daemon.declarations import MAX_OPEN
from kvcached.protocol.declare import declare_socket_path
from tests.conftest import ROOT, DaemonFactory, free_port, unique_devices, zygote
from tests.helpers.fastdeploy_double import FMQDouble
from tests.helpers.fastdeploy_src import pieces, told
from tests.helpers.shared_daemons import shared_daemons
from tests.helpers.zygote import ZygoteChild

#: A module this process (and so the engine's queue server, forked from it) has and the drop-in lacks: an
#: engine whose FastDeploy has a task class the drop-in's does not.
ENGINE_ONLY = types.ModuleType("kvcached_test_engine_only")
sys.modules.setdefault(ENGINE_ONLY.__name__, ENGINE_ONLY)


class EngineOnlyTask:
    """An item the queue server holds and the drop-in cannot unpickle."""


EngineOnlyTask.__module__ = ENGINE_ONLY.__name__
ENGINE_ONLY.EngineOnlyTask = EngineOnlyTask  # type: ignore[attr-defined]

TP = 2
SPEC = rc.CacheSpec(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=16, num_cpu_blocks=8)
GEOMETRY = ["--num-layers", "2", "--kv-heads", "2", "--head-dim", "16", "--block-size", "4"]
GEOMETRY += ["--num-blocks", "16", "--num-cpu-blocks", "8"]


class Engine:
    """FastDeploy's engine side: its flags, its cache queue server and client, its drop-in processes."""

    def __init__(self, tmp_path: Path, instance: str) -> None:
        self.fd = pieces()
        self.tmp_path, self.instance = tmp_path, instance
        self.suffix = 30000 + os.getpid() % 10000 + free_port() % 1000
        self.control = tmp_path / "control"
        self.control.mkdir()
        zeros = np.zeros([TP], dtype=np.int32)
        one = np.zeros([1], dtype=np.int32)
        self.signals = {  # common_engine.py ~392-440 and prefix_cache_manager.py ~186-210: create=True
            name: self.fd.IPCSignal(name=name, array=array, dtype=np.int32, suffix=self.suffix, create=True)
            for name, array in (
                ("cache_ready_signal", zeros),
                ("swap_space_ready_signal", zeros),
                ("cache_transfer_inited_signal", zeros),
                ("kv_cache_status", one),
                ("cache_task_broadcast_signal", one),
                ("cache_task_is_paused", one),
                ("cache_task_inflight", zeros),
            )
        }
        self.port = free_port()
        self.server = self.fd.EngineCacheQueue(  # common_engine.py ~479-486
            address=("127.0.0.1", self.port), is_server=True, num_client=TP, client_id=-1
        )
        self.queue = self.fd.EngineCacheQueue(  # prefix_cache_manager.py ~211-218
            address=("127.0.0.1", self.port), is_server=False, num_client=TP, client_id=0
        )
        self.dropins: list[subprocess.Popen[bytes] | ZygoteChild] = []
        self.output_files: dict[int, Path] = {}

    def value(self, name: str) -> list[int]:
        return [int(v) for v in self.signals[name].value]

    def arguments(self, rank: int, **changes: str) -> list[str]:
        """``cache_transfer_manager.py``'s command line as launch_cache_manager builds it (~296-321), and what
        the patched launcher tells the drop-in (``told``)."""
        args = {
            "device_id": str(rank),
            "rank": str(rank),
            "splitwise_role": "mixed",
            "num_layers": "2",
            "mp_num": str(TP),
            "cache_dtype": "bfloat16",
            "key_cache_shape": "16,2,4,16",
            "value_cache_shape": "16,2,4,16",
            "cache_queue_port": str(self.port),
            "enable_splitwise": "0",
            "pod_ip": "127.0.0.1",
            "engine_worker_queue_port": str(self.suffix),
            "num_cpu_blocks": "8",
            "protocol": "ipc",
            "local_data_parallel_id": "0",
            "rdma_port": "0",
            "speculative_config": "{}",
            "default_dtype": "bfloat16",
            "kvcache_storage_backend": "file",
            "write_policy": "write_through",
            "max_model_len": "1024",
            "model_path": str(self.tmp_path),
        }
        args.update(changes)
        return [part for key, value in args.items() for part in (f"--{key}", value)] + told()

    def launch(self, rank: int, **changes: str) -> subprocess.Popen[bytes] | ZygoteChild:
        """A drop-in for ``rank``; its output (stdout and stderr) goes to a file: ``output``."""
        env = dict(os.environ, KVCACHED_INSTANCE=self.instance, FD_TEST_CONTROL_DIR=str(self.control))
        log = self.tmp_path / f"dropin-{len(self.dropins)}.log"
        script, arguments = str(ROOT / "tests" / "helpers" / "fd_dropin.py"), self.arguments(rank, **changes)
        births = zygote("dropin")
        with open(log, "w") as out:
            if births.forks(env, None):
                proc = births.popen({"path": script}, arguments, env, stdout=out.fileno())
            else:
                proc = subprocess.Popen(
                    [sys.executable, script, *arguments], env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
                )
        self.dropins.append(proc)
        self.output_files[proc.pid] = log
        return proc

    def output(self, proc: subprocess.Popen[bytes] | ZygoteChild | None = None) -> str:
        """What drop-in ``proc`` (default: every one, in launch order) has written so far."""
        procs = self.dropins if proc is None else [proc]
        return "".join(self.output_files[p.pid].read_text(errors="replace") for p in procs)

    def until(self, check: Any, what: str, timeout: float = 30.0) -> Any:
        """``check()`` once true; fails when not within ``timeout`` or when a drop-in has exited before a
        check that was false (seen exited before the check: one that ``check`` waits to see exit passes)."""
        deadline = time.monotonic() + timeout
        while True:
            exited = [proc for proc in self.dropins if proc.poll() is not None]
            got = check()
            if got:
                return got
            if exited:
                raise AssertionError(f"a drop-in exited ({exited[0].returncode}):\n{self.output(exited[0])}")
            assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
            time.sleep(0.005)

    def task(self, item: Any, results: int = 1) -> list[Any]:
        """Put a task, and collect ``results`` done signals for it (recv_data_transfer_result)."""
        self.queue.put_transfer_task(item)
        found: list[Any] = []

        def collect() -> bool:
            data = self.queue.get_transfer_done_signal()
            if data is not None:
                found.append(data)
            return len(found) >= results

        self.until(collect, f"the result of {item[0]}")
        return found

    def control_request(self, method: str) -> list[dict[str, Any]]:
        request = self.fd.ControlRequest(request_id=f"{method}-{time.monotonic_ns()}", method=method)
        self.queue.put_transfer_task((self.fd.CacheStatus.CTRL, request))
        queues = [FMQDouble(self.control, f"ctrl_c2e_rank{rank}_{self.port}") for rank in range(TP)]
        replies: list[dict[str, Any]] = []

        def collect() -> bool:
            for queue in queues:
                replies.extend(queue.get_all())
            return len(replies) >= TP

        self.until(collect, f"the responses to {method}")
        assert {r["request_id"] for r in replies} == {request.request_id}
        return replies

    def close(self) -> None:
        for proc in self.dropins:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for holder in self.signals.values():
            with contextlib.suppress(FileNotFoundError):
                holder.shm.unlink()
        with contextlib.suppress(Exception):
            self.server.manager.shutdown()


@contextlib.contextmanager
def engine_of(daemons: DaemonFactory, tmp_path: Path) -> Iterator[Engine]:
    """A 2-rank daemon with a file store, and the engine's side (no drop-in launched yet)."""
    daemon = daemons.start(
        ranks=TP, small=False, args=[*GEOMETRY, "--storage-backend", "file", "--storage-path", str(tmp_path / "store")]
    )
    daemon.wait_ready()
    made = Engine(tmp_path, daemon.instance)
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def engine(daemons: DaemonFactory, tmp_path: Path) -> Iterator[Engine]:
    with engine_of(daemons, tmp_path) as made:
        yield made


@pytest.fixture(scope="class")
def idle_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """``engine`` for the tests of a class whose drop-ins are each refused before they join the queue or set
    a flag: one daemon and one engine side serve them all."""
    tmp = tmp_path_factory.mktemp("idle-engine")
    with shared_daemons(tmp) as daemons, engine_of(daemons, tmp) as made:
        yield made


def blocks(cache: rc.KVCache, ids: list[int]) -> bytes:
    return b"".join(t[i].tobytes() for t in cache.key_caches + cache.value_caches for i in ids)


def test_the_engine_is_served_by_the_drop_in(engine: Engine) -> None:
    """Acceptance: the drop-in for 2 ranks allocates nothing, sets the flags, and serves SWAP2CPU, SWAP2GPU, a
    storage write and read, pause and resume, sleep (200, saying it frees no memory), the bytes right at each
    step."""
    fd, status = engine.fd, engine.fd.CacheStatus
    for rank in range(TP):
        engine.launch(rank)
    engine.until(lambda: engine.value("cache_transfer_inited_signal") == [1, 1], "cache_transfer_inited_signal")
    assert engine.value("cache_ready_signal") == [1, 1] and engine.value("swap_space_ready_signal") == [1, 1]
    caches = [rc.initialize_kv_cache(SPEC, rank, instance=engine.instance) for rank in range(TP)]
    try:
        rng = np.random.default_rng(7)
        for cache in caches:
            for t in cache.key_caches + cache.value_caches:
                t.view(np.uint8)[...] = rng.integers(0, 256, t.view(np.uint8).shape, dtype=np.uint8)
        original = [blocks(c, [1, 2]) for c in caches]

        done = engine.task((status.SWAP2CPU, "t1", [11, 12], [1, 2], [0, 1]))
        assert done[0][0] == status.SWAP2CPU and done[0][1:] == ("t1", [11, 12], [1, 2], [0, 1])
        assert [blocks(c, [1, 2]) for c in caches] == original
        for cache in caches:
            for t in cache.key_caches + cache.value_caches:
                t[1:3] = 0
        done = engine.task((status.SWAP2GPU, "t2", [11, 12], [3, 4], [0, 1]))
        assert done[0][0] == status.SWAP2GPU and done[0][3:] == ([3, 4], [0, 1])
        assert [blocks(c, [3, 4]) for c in caches] == original

        write = fd.WriteStorageTask(task_id="w1", keys=["h1", "h2"], token_ids=[], gpu_block_ids=[3, 4])
        done = engine.task((status.GPU2STORAGE, write))
        assert done[0][0] == status.GPU2STORAGE and done[0][1:] == ("w1", ["h1", "h2"], [3, 4])
        read = fd.ReadStorageTask(
            task_id="r1", keys=["h1", "h2"], token_ids=[], gpu_block_ids=[5, 6], start_read_block_idx=0
        )
        done = engine.task((status.STORAGE2GPU, read), results=TP)  # every rank reports a read
        assert [d[1:] for d in done] == [("r1", ["h1", "h2"], [5, 6])] * TP
        assert [blocks(c, [5, 6]) for c in caches] == original
        again = engine.task((status.GPU2STORAGE, write))
        assert again[0][3] == [], "both keys are stored already: nothing written"

        replies = engine.control_request("pause")
        assert [r["error_code"] for r in replies] == [200, 200]
        engine.until(lambda: engine.value("cache_task_inflight") == [0, 0], "paused")
        assert engine.value("cache_task_is_paused") == [1]
        replies = engine.control_request("resume")
        assert [r["error_code"] for r in replies] == [200, 200]
        engine.until(lambda: engine.value("cache_task_inflight") == [1, 1], "resumed")
        slept = engine.control_request("sleep")
        assert [r["error_code"] for r in slept] == [200, 200] and "frees no memory" in slept[0]["error_message"]

        done = engine.task((status.SWAP2CPU, "t3", [13], [5], [7]))  # served after the pause
        assert done[0][1] == "t3"
    finally:
        for cache in caches:
            cache.close()


class TestRefusedByName:
    """Drop-ins the daemon refuses: none of them joins the queue or sets a flag."""

    @pytest.mark.parametrize(
        ("field", "changes"),
        [
            ("key_cache_shape", {"key_cache_shape": "16,2,4,32", "value_cache_shape": "16,2,4,32"}),
            ("value_cache_shape", {"value_cache_shape": ""}),
            ("num_layers", {"num_layers": "3"}),
            ("num_cpu_blocks", {"num_cpu_blocks": "9"}),
            ("cache_dtype", {"cache_dtype": "uint8"}),
            ("local_data_parallel_id", {"local_data_parallel_id": "1"}),
            ("kvcache_storage_backend", {"kvcache_storage_backend": "mooncake"}),
        ],
    )
    def test_a_mismatch_is_refused_by_name_before_anything_moves(
        self, idle_engine: Engine, field: str, changes: dict[str, str]
    ) -> None:
        """The engine's idea of the cache differs from the daemon's in one field: the drop-in exits 4 naming
        it, before it joins the queue or sets a flag."""
        engine = idle_engine
        proc = engine.launch(0, **changes)
        assert proc.wait(60) == 4
        assert f"--{field}:" in engine.output(proc)
        assert engine.value("cache_transfer_inited_signal") == [0, 0] and engine.value("cache_ready_signal") == [0, 0]


def test_a_malformed_queue_item_is_logged_and_the_next_task_served(engine: Engine) -> None:
    """Items on the cache queue that are no FastDeploy task (garbage, a task with a field missing) are logged
    and skipped; a swap-out whose ids are not ids is reported with nothing moved (its engine waits for a
    result: the not-moved form keeps its GPU copies, handlers.py); the drop-ins serve the next task."""
    status = engine.fd.CacheStatus
    for rank in range(TP):
        engine.launch(rank)
    engine.until(lambda: engine.value("cache_transfer_inited_signal") == [1, 1], "cache_transfer_inited_signal")
    for item in ("garbage", (status.SWAP2CPU, "no ids"), 12345):
        engine.queue.put_transfer_task(item)
    refused = engine.task((status.SWAP2CPU, "t0", [1], "not ids", [0]))
    assert refused[0][1:] == ("t0", [], [], [])
    done = engine.task((status.SWAP2CPU, "t1", [11], [1], [0]))
    assert done[0][1:] == ("t1", [11], [1], [0])
    assert all(proc.poll() is None for proc in engine.dropins), "a drop-in died of a malformed item"
    engine.close()
    logs = engine.output()
    assert logs.count("that is not a task") >= 3, logs[-2000:]
    assert "swap out 't0'" in logs and "it is not a task kvcached can run" in logs, logs[-2000:]


def test_a_queue_item_the_drop_in_cannot_read_is_logged_and_the_next_task_served(engine: Engine) -> None:
    """An item taken off the queue that the drop-in cannot even unpickle (its class is the engine's only) costs
    that item: rank 0's drop-in logs it and serves the next task (it used to die of it, and the engine with it)."""
    status = engine.fd.CacheStatus
    for rank in range(TP):
        engine.launch(rank)
    engine.until(lambda: engine.value("cache_transfer_inited_signal") == [1, 1], "cache_transfer_inited_signal")
    engine.queue.put_transfer_task((status.SWAP2CPU, EngineOnlyTask()))
    engine.until(engine.queue.empty, "the item taken")
    done = engine.task((status.SWAP2CPU, "t1", [11], [1], [0]))
    assert done[0][1:] == ("t1", [11], [1], [0])
    assert all(proc.poll() is None for proc in engine.dropins), "a drop-in died of an item it cannot read"
    engine.close()
    logs = engine.output()
    assert "not a task (it cannot be read" in logs and "kvcached_test_engine_only" in logs, logs[-2000:]


def test_a_drop_in_start_beside_thirty_two_silent_declarers_declares_serves_and_exits_0(
    daemons: DaemonFactory, tmp_path: Path
) -> None:
    """A neighbour of the daemon's user holds as many silent connections to the declaration socket as the daemon
    serves at once: the drop-ins of a ``--geometry engine`` daemon are told busy (never a wrong geometry), ask
    again, declare, serve a swap, and exit 0 once the engine is gone."""
    store = ["--storage-backend", "file", "--storage-path", str(tmp_path / "store")]
    daemon = daemons.start(ranks=TP, small=False, args=["--geometry", "engine", *store])
    daemon.wait_state("EMPTY")
    silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(MAX_OPEN)]
    made = Engine(tmp_path, daemon.instance)
    try:
        for sock in silent:
            sock.connect(str(declare_socket_path(daemons.run_dir, daemon.instance)))
        dropins = [made.launch(rank) for rank in range(TP)]
        made.until(lambda: made.value("cache_transfer_inited_signal") == [1] * TP, "the drop-ins serve", 60)
        status = made.fd.CacheStatus
        done = made.task((status.SWAP2CPU, "t1", [11], [1], [0]))
        assert done[0][1:] == ("t1", [11], [1], [0])
        made.server.manager.shutdown()  # the engine is gone
        assert [proc.wait(60) for proc in dropins] == [0] * TP, made.output()
    finally:
        for sock in silent:
            sock.close()
        made.close()


def test_a_device_id_other_than_the_ranks_device_is_refused(daemons: DaemonFactory, tmp_path: Path) -> None:
    """kvcached keeps rank 0 on a device other than 0 (``--devices``, the xpu backend over the TEST DOUBLE of
    its runtime): a drop-in told ``--device_id 0`` exits 4 naming it, before it joins the queue."""
    pytest.importorskip("paddle")
    env = daemons.env(KVCACHED_PLUGINS="tests.plugins.xpu_double")
    devices = unique_devices(TP)
    args = [
        "--memory",
        "xpu-double",
        "--devices",
        ",".join(map(str, devices)),
        *GEOMETRY,
        "--storage-backend",
        "file",
        "--storage-path",
        str(tmp_path / "store"),
    ]
    daemons.start(ranks=TP, small=False, args=args, env=env).wait_ready()
    made = Engine(tmp_path, daemons.daemons[-1].instance)
    try:
        proc = made.launch(0, device_id="0")
        assert proc.wait(60) == 4
        assert f"--device_id: the engine says 0, kvcached keeps this rank on device {devices[0]}" in made.output(proc)
        assert made.value("cache_transfer_inited_signal") == [0, 0]
    finally:
        made.close()
