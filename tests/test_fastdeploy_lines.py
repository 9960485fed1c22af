"""The drop-in served by every FastDeploy line's own cache queue, over that line's default transport and the
other one (``FASTDEPLOY_SRC``: a git clone holding the lines; see ``tests/helpers/fastdeploy_lines.py``).

For each line, the engine side is that line's ``engine_cache_queue.py`` and ``ipc_signal.py``, listening where
that line's engine listens (its own ``envs.py`` reads ``FD_ENGINE_TASK_QUEUE_WITH_SHM``); the drop-ins are told
where by what the line's patch passes them (``told``: the patch's own lines, run on the launcher's address).
Swaps move the right bytes; a storage write is reported as that line's engine collects it (2.6: every rank,
the blocks the store holds; the others: rank 0, the blocks written), a storage read by every rank. On
e53f5184 the cache queue has no socket: with the variable set, engine and drop-in stay on TCP.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import runner_client as rc
from kvcached.fastdeploy.lines import read_tree
from tests.conftest import DaemonFactory
from tests.helpers import fastdeploy_lines
from tests.helpers.fastdeploy_lines import LineEngine, fastdeploy_modules, tree_of
from tests.helpers.fastdeploy_src import told

line_trees, patched_trees = fastdeploy_lines.line_trees, fastdeploy_lines.patched_trees  # session fixtures

TP = 2
SPEC = rc.CacheSpec(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=16, num_cpu_blocks=8)
GEOMETRY = ["--num-layers", "2", "--kv-heads", "2", "--head-dim", "16", "--block-size", "4"]
GEOMETRY += ["--num-blocks", "16", "--num-cpu-blocks", "8"]
#: (commit, FD_ENGINE_TASK_QUEUE_WITH_SHM or None for unset, the transport expected)
CASES = [
    ("e53f5184", None, "tcp"),
    ("e53f5184", "1", "tcp"),
    ("41677b9a6", None, "unix"),
    ("41677b9a6", "0", "tcp"),
    ("564c78d78", None, "unix"),
    ("564c78d78", "0", "tcp"),
]


def arguments(tmp_path: Path) -> list[str]:
    """The rest of ``cache_transfer_manager.py``'s command line as each line's launcher builds it."""
    args = {
        "splitwise_role": "mixed",
        "num_layers": "2",
        "cache_dtype": "bfloat16",
        "key_cache_shape": "16,2,4,16",
        "value_cache_shape": "16,2,4,16",
        "enable_splitwise": "0",
        "num_cpu_blocks": "8",
        "protocol": "ipc",
        "local_data_parallel_id": "0",
        "rdma_port": "0",
        "speculative_config": "{}",
        "default_dtype": "bfloat16",
        "kvcache_storage_backend": "file",
        "write_policy": "write_through",
        "max_model_len": "1024",
        "model_path": str(tmp_path),
    }
    return [part for key, value in args.items() for part in (f"--{key}", value)]


@pytest.fixture
def daemon_instance(daemons: DaemonFactory, tmp_path: Path) -> str:
    store = ["--storage-backend", "file", "--storage-path", str(tmp_path / "store")]
    daemon = daemons.start(ranks=TP, small=False, args=[*GEOMETRY, *store])
    daemon.wait_ready()
    return daemon.instance


EngineFor = Callable[[str, str | None], LineEngine]


@pytest.fixture
def engine_for(
    patched_trees: dict[str, Path], daemon_instance: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[EngineFor]:
    """``engine_for(commit, FD_ENGINE_TASK_QUEUE_WITH_SHM)``: that line's engine side (its tree patched, as the
    drop-in only runs under the patched launcher) with a drop-in per rank."""
    with contextlib.ExitStack() as stack:

        def make(commit: str, variable: str | None) -> LineEngine:
            if variable is None:
                monkeypatch.delenv("FD_ENGINE_TASK_QUEUE_WITH_SHM", raising=False)
            else:
                monkeypatch.setenv("FD_ENGINE_TASK_QUEUE_WITH_SHM", variable)
            tree = tree_of(patched_trees, commit)
            fd = stack.enter_context(fastdeploy_modules(tree))
            engine = LineEngine(fd, commit, tree, daemon_instance, TP)
            stack.callback(engine.close)
            control = tmp_path / "control"
            control.mkdir()
            for rank in range(TP):
                engine.launch(rank, control, arguments(tmp_path))
            return engine

        yield make


def blocks(cache: rc.KVCache, ids: list[int]) -> bytes:
    return b"".join(t[i].tobytes() for t in cache.key_caches + cache.value_caches for i in ids)


@pytest.mark.parametrize(("commit", "variable", "transport"), CASES)
def test_each_line_drives_the_drop_in_over_its_transport(
    engine_for: EngineFor, commit: str, variable: str | None, transport: str
) -> None:
    """Acceptance: each line's own queue code, over its default transport and the other one, drives swaps
    out and in (bytes equal), a storage write and a storage read (bytes equal) through the drop-in."""
    engine = engine_for(commit, variable)
    assert (transport == "unix") == isinstance(engine.address, str), engine.address
    if isinstance(engine.address, str):
        assert os.path.exists(engine.address), "the engine listens on the line's socket"
    status, fd = engine.fd.CacheStatus, engine.fd
    engine.until(lambda: engine.value("cache_transfer_inited_signal") == [1] * TP, "cache_transfer_inited_signal")
    assert engine.value("cache_ready_signal") == [1] * TP and engine.value("swap_space_ready_signal") == [1] * TP
    caches = [rc.initialize_kv_cache(SPEC, rank, instance=engine.instance) for rank in range(TP)]
    try:
        rng = np.random.default_rng(21)
        for cache in caches:
            for t in cache.key_caches + cache.value_caches:
                t.view(np.uint8)[...] = rng.integers(0, 256, t.view(np.uint8).shape, dtype=np.uint8)
        original = [blocks(c, [1, 2]) for c in caches]

        done = engine.task((status.SWAP2CPU, "t1", [11, 12], [1, 2], [0, 1]))
        assert done[0][0] == status.SWAP2CPU and done[0][1:] == ("t1", [11, 12], [1, 2], [0, 1])
        for cache in caches:
            for t in cache.key_caches + cache.value_caches:
                t[1:3] = 0
        done = engine.task((status.SWAP2GPU, "t2", [11, 12], [3, 4], [0, 1]))
        assert done[0][0] == status.SWAP2GPU and done[0][3:] == ([3, 4], [0, 1])
        assert [blocks(c, [3, 4]) for c in caches] == original

        every_rank = commit == "41677b9a6"
        write = fd.WriteStorageTask(task_id="w1", keys=["h1", "h2"], token_ids=[], gpu_block_ids=[3, 4])
        done = engine.task((status.GPU2STORAGE, write), results=TP if every_rank else 1)
        assert [d[1:] for d in done] == [("w1", ["h1", "h2"], [3, 4])] * len(done)
        read = fd.ReadStorageTask(
            task_id="r1", keys=["h1", "h2"], token_ids=[], gpu_block_ids=[5, 6], start_read_block_idx=0
        )
        done = engine.task((status.STORAGE2GPU, read), results=TP)
        assert [d[1:] for d in done] == [("r1", ["h1", "h2"], [5, 6])] * TP
        assert [blocks(c, [5, 6]) for c in caches] == original
        again = engine.task((status.GPU2STORAGE, write), results=TP if every_rank else 1)
        assert [d[3] for d in again] == ([[3, 4]] * TP if every_rank else [[]]), "stored already: nothing written"
    finally:
        for cache in caches:
            cache.close()


def test_each_lines_patch_tells_the_drop_in_what_its_tree_does(line_trees: dict[str, Path]) -> None:
    """What each line's patch tells the drop-in agrees with that line's own source, as ``kvcached doctor`` reads
    it: 2.6's engine stops waiting for a storage write after 60 s and reuses the blocks
    (``wait_write_storage_task(timeout=60.0)``) and collects one report per rank; the other lines wait until
    rank 0's report comes; the queue is on the line's Unix socket when its manager has one. A line that changed
    under its patch fails here."""
    expected = {"e53f5184": (None, "rank0"), "41677b9a6": (60.0, "every-rank"), "564c78d78": (None, "rank0")}
    for commit, tree in line_trees.items():
        read = read_tree(tree)
        told_socket = dict(zip(*[iter(told(commit, "/dev/shm/fd_task_queue_1.sock"))] * 2, strict=True))
        wait, reports = expected[commit]
        assert read.write_wait_s == wait and (told_socket["--kvcached-write-wait"] == "none") == (wait is None)
        assert wait is None or float(told_socket["--kvcached-write-wait"]) == wait
        assert told_socket["--kvcached-write-reports"] == reports
        assert (reports == "every-rank") == read.writes_reported_by_every_rank, commit
        assert (told_socket["--kvcached-queue"] != "tcp") == (read.queue.socket is not None), commit
        assert told_socket["--kvcached-line"] == commit
