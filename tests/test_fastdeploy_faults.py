"""The drop-in under faults a hostile operator meets: ranks whose parts of a task end at different times, a
slow store, a paused engine, a task put while paused, settings that are not numbers.

Played as ``tests/test_fastdeploy_engine.py`` plays FastDeploy's engine (its flags, its cache queue server
and client, one drop-in process per rank with ``cache_transfer_manager.py``'s arguments): with
``FASTDEPLOY_SRC`` the queue, the flags, ``CacheStatus`` and the storage tasks are FastDeploy's own files;
without it, the doubles of ``tests/helpers/fastdeploy_double.py``. ``tests/test_fastdeploy_engine_code.py`` drives
the same faults through FastDeploy's own engine code. Real daemons, real store agents, real signals.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import runner_client as rc
from kvcached.fastdeploy.arguments import store_key
from kvcached.fastdeploy.mover import Mover, Outcome
from kvcached.status import read_status
from tests.conftest import DaemonFactory
from tests.helpers.procs import halt
from tests.test_fastdeploy_engine import GEOMETRY, SPEC, TP, Engine, blocks

#: Blocks of the spec the tests fill, store and load.
SOURCE, TARGET = [4, 5, 6, 7], [8, 9, 10, 11]
#: What a drop-in logs once a wait on a live engine has passed its deadline.
WAITS_ON = "is alive, so the drop-in waits on"


@contextlib.contextmanager
def served(
    daemons: DaemonFactory, tmp_path: Path, *args: str, fault: str = "", stop_timeout: float | None = None, **env: str
) -> Iterator[tuple[Engine, Any]]:
    """A daemon with a file store (``args`` added; ``fault``: its ``KVCACHED_FAULT``; ``stop_timeout``: its
    workers' grace at the teardown's stop), and both ranks' drop-ins serving the engine (their environment
    with ``env``)."""
    store = ["--storage-backend", "file", "--storage-path", str(tmp_path / "store")]
    extra = {"KVCACHED_FAULT": fault} if fault else {}
    daemon = daemons.start(
        ranks=TP, small=False, args=[*GEOMETRY, *store, *args], env=daemons.env(**extra), stop_timeout=stop_timeout
    )
    daemon.wait_ready()
    engine = Engine(tmp_path, daemon.instance)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # Engine.launch passes this process's environment on
    try:
        for rank in range(TP):
            engine.launch(rank)
        engine.until(lambda: engine.value("cache_transfer_inited_signal") == [1] * TP, "both drop-ins serving")
        yield engine, daemon
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        engine.close()


def logs(engine: Engine) -> str:
    """The drop-ins' output, once they have ended (``Engine.close``)."""
    engine.close()
    return engine.output()


def views(instance: str) -> list[rc.KVCache]:
    return [rc.initialize_kv_cache(SPEC, rank, instance=instance, timeout=30) for rank in range(TP)]


def fill(caches: list[rc.KVCache], ids: list[int], value: int | None = None, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for cache in caches:
        for tensor in cache.key_caches + cache.value_caches:
            for i in ids:
                view = tensor[i].view(np.uint8)
                view[...] = value if value is not None else rng.integers(0, 256, view.shape, dtype=np.uint8)


def store_agent(instance: str, rank: int) -> int:
    """The pid of ``rank``'s store agent (the one child of its worker)."""
    worker = read_status(instance)["ranks"][rank]["pid"]
    return int(Path(f"/proc/{worker}/task/{worker}/children").read_text().split()[0])


def write(engine: Engine, task_id: str, keys: list[str], ids: list[int], timeout: float = 30.0) -> list[Any]:
    task = engine.fd.WriteStorageTask(task_id=task_id, keys=keys, token_ids=[], gpu_block_ids=ids, timeout=timeout)
    done = engine.task((engine.fd.CacheStatus.GPU2STORAGE, task))
    return list(done[0][3])


def read(engine: Engine, task_id: str, keys: list[str], ids: list[int], timeout: float = 30.0) -> list[int]:
    task = engine.fd.ReadStorageTask(
        task_id=task_id, keys=keys, token_ids=[], gpu_block_ids=ids, start_read_block_idx=0, timeout=timeout
    )
    done = engine.task((engine.fd.CacheStatus.STORAGE2GPU, task), results=TP)
    return min((list(d[3]) for d in done), key=len)  # the engine takes the shortest


def test_a_read_is_reported_only_once_every_ranks_part_has_ended(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Rank 0's load fails (its store agent stopped: the store timeout, 1 s) while rank 1's is held up (its
    worker stopped for 2.5 s): the read is reported, as nothing loaded, only once rank 1's load has ended, so
    nothing lands in the blocks the engine recycles and computes into once it has the answer (looked at
    1.5 s after rank 1 continues: a load reported too early would have landed by then)."""
    keys = [f"race-{i}" for i in range(len(SOURCE))]
    with served(daemons, tmp_path, "--store-timeout", "1") as (engine, daemon):
        caches = views(daemon.instance)
        fill(caches, SOURCE, seed=7)
        assert write(engine, "w", keys, SOURCE) == SOURCE
        stopped = [store_agent(daemon.instance, 0), read_status(daemon.instance)["ranks"][1]["pid"]]
        for pid in stopped:
            halt(pid)
        continued = time.monotonic() + 2.5
        threading.Timer(2.5, os.kill, (stopped[1], signal.SIGCONT)).start()
        try:
            assert read(engine, "r", keys, TARGET) == []
            fill(caches, TARGET, value=0x77)  # the engine recycles the blocks; a new request computes into them
            time.sleep(max(continued + 1.5 - time.monotonic(), 0))  # a load still under way would land by then
            assert blocks(caches[1], TARGET) == bytes([0x77]) * len(blocks(caches[1], TARGET))
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            for cache in caches:
                cache.close()


def test_a_write_is_reported_only_once_every_ranks_part_has_ended(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Rank 0's put fails at once (its object directories are files) while rank 1's is slow (each object
    its agent moves takes 0.25 s more): the write is reported only once rank 1's put has ended, so the
    blocks the engine then reuses never reach the store under the old keys. The same prompt written again
    and read back loads its own KV on every rank (or nothing)."""
    keys = [f"late-{i}" for i in range(len(SOURCE))]
    store = tmp_path / "store"
    with served(daemons, tmp_path, "--store-timeout", "10", fault="store-step:sleep=0.25") as (engine, daemon):
        caches = views(daemon.instance)
        fill(caches, SOURCE, seed=7)
        truth = [blocks(c, SOURCE) for c in caches]
        planted = []
        for key in keys:
            where = store / "r0" / store_key(key, "").hex()[:2]
            if where not in planted:
                where.rmdir()  # the empty object subdirectory the store made at start
                where.write_text("not a directory")
                planted.append(where)
        try:
            assert write(engine, "w1", keys, SOURCE) == [], "rank 0 stored nothing: nothing is reported written"
            fill(caches, SOURCE, seed=99)  # the request is done: its blocks are reused
            time.sleep(1.5)  # a put still under way (1 s for its 4 objects) would store the reused blocks now
        finally:
            for where in planted:
                where.unlink()
        fill(caches, SOURCE, seed=7)  # the prompt's KV again, written again
        write(engine, "w2", keys, SOURCE)
        fill(caches, TARGET, value=0)
        loaded = read(engine, "r", keys, TARGET)
        assert loaded == TARGET, "the second write stored every block"
        assert [blocks(c, TARGET) for c in caches] == truth, "a rank loaded KV that is not the prompt's"
        for cache in caches:
            cache.close()


def test_a_slow_read_is_cut_off_at_its_deadline_and_the_rank_serves_on(daemons: DaemonFactory, tmp_path: Path) -> None:
    """A store that keeps moving but slowly (1 s more per object loaded) and a read whose deadline is 2 s
    (``ReadStorageTask.timeout``): the read is cut off there, reporting the blocks every rank loaded by then
    (a prefix, byte for byte), the log names the deadline, and the drop-in serves the next task."""
    keys = [f"slow-{i}" for i in range(8)]
    ids, target = list(range(8)), list(range(8, 16))
    with served(daemons, tmp_path, "--store-timeout", "10", fault="load-step:sleep=1") as (engine, daemon):
        caches = views(daemon.instance)
        fill(caches, ids, seed=3)
        assert write(engine, "w", keys, ids) == ids
        fill(caches, target, value=0)
        loaded = read(engine, "r", keys, target, timeout=2.0)
        assert 0 < len(loaded) < len(keys) and loaded == target[: len(loaded)], loaded
        assert [blocks(c, loaded) for c in caches] == [blocks(c, ids[: len(loaded)]) for c in caches]
        done = engine.task((engine.fd.CacheStatus.SWAP2CPU, "after", [1], [1], [0]))
        assert done[0][1] == "after" and all(proc.poll() is None for proc in engine.dropins)
        said = logs(engine)
        assert "cut off at its deadline (2s)" in said and "cannot be served" not in said, said[-2000:]
        for cache in caches:
            cache.close()


def test_a_task_taken_while_paused_is_logged_by_name(daemons: DaemonFactory, tmp_path: Path) -> None:
    """FastDeploy's own transfer loop drops a task taken while paused, silently (``continue``); the drop-in
    drops it too, and says so, naming the task: a hang the engine may then see is never a silent one."""
    with served(daemons, tmp_path) as (engine, _):
        assert [r["error_code"] for r in engine.control_request("pause")] == [200] * TP
        engine.queue.put_transfer_task((engine.fd.CacheStatus.SWAP2GPU, "while-paused", [1], [6], [1]))
        engine.until(engine.queue.empty, "the task taken")
        said = "SWAP2GPU task 'while-paused' taken while the transfer loop is paused"
        engine.until(lambda: said in engine.output(), "the task logged")
        assert said in logs(engine)


@pytest.mark.slow
def test_a_paused_engine_is_waited_for(daemons: DaemonFactory, tmp_path: Path) -> None:
    """The engine's queue server stopped (``SIGSTOP``) until both drop-ins have waited on it past every
    deadline they have (``KVCACHED_TASK_DEADLINE_S`` 2 plus ``KVCACHED_QUEUE_SLACK_S`` 1: 3 s): the engine
    process is alive, so both wait on, logging why, and serve once it continues. (A dead engine ends them:
    ``tests/test_fastdeploy_engine_code.py``.)"""
    with served(daemons, tmp_path, KVCACHED_TASK_DEADLINE_S="2", KVCACHED_QUEUE_SLACK_S="1") as (engine, _):
        server = engine.server.manager._process.pid
        halt(server)
        try:
            engine.until(
                lambda: all(WAITS_ON in engine.output(proc) for proc in engine.dropins),
                "both drop-ins waiting on, past their deadline",
            )
        finally:
            os.kill(server, signal.SIGCONT)
        done = engine.task((engine.fd.CacheStatus.SWAP2CPU, "after-pause", [1], [1], [0]))
        assert done[0][1] == "after-pause" and all(proc.poll() is None for proc in engine.dropins)
        said = logs(engine)
        assert "the engine (pid" in said and WAITS_ON in said, said[-2000:]
        assert "cannot be served" not in said


def test_what_the_drop_in_cannot_serve_is_refused_by_name_before_it_joins(
    daemons: DaemonFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exit 4, naming the cause, before the drop-in joins the queue or sets a flag: MTP in a second
    data-parallel group (FastDeploy's MTP proposer attaches by names kvcached's ranks do not have there),
    a platform other than XPU (kvcached has no device backend for it; the test adapter's platform is a
    DOUBLE), a version.yaml FastDeploy could not read either."""
    store = ["--storage-backend", "file", "--storage-path", str(tmp_path / "store")]
    daemon = daemons.start(ranks=TP, small=False, args=[*GEOMETRY, *store])
    daemon.wait_ready()
    engine = Engine(tmp_path, daemon.instance)
    try:
        mtp = '{"method": "mtp", "num_extra_cache_layer": 1}'
        proc = engine.launch(0, mp_num="1", local_data_parallel_id="1", speculative_config=mtp)
        assert proc.wait(60) == 4
        assert "--local_data_parallel_id: data-parallel group 1 with MTP" in engine.output(proc)
        monkeypatch.setenv("KVCACHED_TEST_FD_PLATFORM", "gpu")
        proc = engine.launch(0)
        assert proc.wait(60) == 4
        assert "FastDeploy runs on gpu here: kvcached has no gpu device backend" in engine.output(proc)
        monkeypatch.delenv("KVCACHED_TEST_FD_PLATFORM")
        (tmp_path / "version.yaml").write_text("version: [RL-STEP1\n")
        proc = engine.launch(0)
        assert proc.wait(60) == 4
        assert "--model_path: " in engine.output(proc)
        assert (
            engine.value("cache_transfer_inited_signal") == [0] * TP and engine.value("cache_ready_signal") == [0] * TP
        )
    finally:
        engine.close()


def test_a_write_still_running_when_the_engine_stops_waiting_ends_the_rank_first(
    daemons: DaemonFactory, tmp_path: Path
) -> None:
    """An engine that stops waiting for a write (2.6: 60 s) reuses its blocks: a part still running then would
    store the reused blocks under the task's keys (stored KV that is not the prompt's: wrong answers later). A
    write whose parts are slow (each object its agent moves takes 4 s more) ends as unservable by the time
    the engine's wait gives (``by``, 1.5 s here), though its own deadline plus the slack a part is otherwise
    given runs far longer; nothing of it is reported stored."""
    slow = "store-step:sleep=4"  # the stop at the end gives the part still writing 1 s, not the default 5
    with served(daemons, tmp_path, "--store-timeout", "60", fault=slow, stop_timeout=1.0) as (engine, daemon):
        mover = Mover(daemon.instance, list(range(TP)), 60.0)
        try:
            started = time.monotonic()
            keys = [store_key(f"late-{i}", "") for i in range(2)]
            done = mover.store(keys, SOURCE[:2], 1.0, "storage write 'w'", by=started + 1.5)
            took = time.monotonic() - started
        finally:
            mover.close()
        assert done.outcome is Outcome.UNSERVABLE and done.blocks == 0, done
        assert "may still write" in done.why and took < 4, (took, done)
        engine.close()
