"""FastDeploy's own engine code (e53f5184, patched) served by the drop-in and a real daemon, at a realistic
geometry: 16 layers, 2 ranks, a file store, the daemon started with ``--geometry engine`` (no geometry
given to kvcached: the engine's drop-ins and runners declare it).

The engine side is ``tests/helpers/fd_engine.py`` (its STUBS are listed in ``tests/helpers/fastdeploy_shell.py``):
FastDeploy's ``PrefixCacheManager`` launches the drop-ins with its ``launch_cache_manager``, reads their
results with its result thread, and its ``issue_swap_task``, ``request_match_blocks`` (with its own block
hashing), ``write_cache_to_storage_decode`` and control waiter (over its FMQ) are the calls. The bytes are
checked through the runners' views. Skipped without ``FASTDEPLOY_SRC`` (a checkout of e53f5184).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from kvcached.fastdeploy.transfer_manager import TASK_S
from kvcached.status import read_status
from tests.conftest import DaemonFactory
from tests.helpers import fastdeploy_engine_code
from tests.helpers.fastdeploy_engine_code import (
    GEOMETRY,
    EngineEnded,
    Shared,
    blocks,
    configured,
    engine_and_daemon,
    fill,
    views,
)
from tests.helpers.procs import halt

shared_engine, shared = fastdeploy_engine_code.shared_engine, fastdeploy_engine_code.shared  # fixtures
BLOCK = GEOMETRY["block_size"]


class TestOneLaunchedEngine:
    """Tests that neither stop, kill nor reconfigure the engine or its daemon: one of each serves them all."""

    def test_the_engine_declares_the_geometry_and_swaps_move_the_bytes(self, shared: Shared) -> None:
        """With no geometry given to the daemon, FastDeploy's launch makes it allocate FastDeploy's own block
        count; a swap out, an overwrite and a swap in issued by ``issue_swap_task`` bring the bytes back."""
        engine, daemon = shared.engine, shared.daemon
        assert shared.launched["inited"] == [1, 1]
        spec = read_status(daemon.instance)["spec"]
        assert (spec["num_blocks"], spec["num_layers"], spec["num_cpu_blocks"]) == (64, 16, 32)
        caches = views(daemon.instance)
        fill(caches, [1, 2, 3], seed=1)
        original = blocks(caches, [1, 2, 3])
        engine.call("swap", event="SWAP2CPU", task_id="out", gpu=[1, 2, 3], cpu=[30, 31, 0], nodes=None)
        fill(caches, [1, 2, 3], seed=2)
        engine.call("swap", event="SWAP2GPU", task_id="in", gpu=[7, 8, 9], cpu=[30, 31, 0], nodes=None)
        assert blocks(caches, [7, 8, 9]) == original

    def test_a_prompt_of_four_and_a_half_blocks_loads_four_from_the_store(self, shared: Shared) -> None:
        """``write_cache_to_storage_decode`` stores a prompt's 4 full blocks (FastDeploy's chained hashes); a new
        request for it (4.5 blocks unmatched) gets those 4 blocks loaded byte for byte and reported, its 5th
        GPU block recycled, 64 tokens counted as cached."""
        engine, daemon = shared.engine, shared.daemon
        prompt = list(range(1000, 1000 + 4 * BLOCK + BLOCK // 2))
        caches = views(daemon.instance)
        fill(caches, [40, 41, 42, 43], seed=3)
        engine.call("write_decode", request_id="first", prompt=prompt, block_tables=[40, 41, 42, 43, 44])
        free = len(engine.call("nodes", ids=[])["gpu_free"])
        got = engine.call("match", request_id="second", prompt=prompt)
        assert got["tokens"] == 4 * BLOCK and got["storage_blocks"] == got["blocks"] and len(got["blocks"]) == 4
        assert not set(got["blocks"]) & {40, 41, 42, 43}
        assert blocks(caches, got["blocks"]) == blocks(caches, [40, 41, 42, 43])
        assert len(got["gpu_free"]) == free - 4, "the fifth block went back to the free list"

    def test_a_refused_swap_out_is_reported_with_nothing_moved(self, shared: Shared) -> None:
        """Eviction to a CPU block kvcached refuses: the engine's nodes stay SWAP2CPU on their GPU blocks (never
        recycled, their bytes kept), and the engine goes on: the next swap is served."""
        engine, daemon = shared.engine, shared.daemon
        mark = engine.log_mark()
        caches = views(daemon.instance)
        fill(caches, [5, 6], seed=4)
        before = blocks(caches, [5, 6])
        engine.call(
            "make_nodes",
            nodes=[
                {"node_id": 900, "status": "SWAP2CPU", "block_id": 5},
                {"node_id": 901, "status": "SWAP2CPU", "block_id": 6},
            ],
        )
        engine.call("swap", event="SWAP2CPU", task_id="refused", gpu=[5, 6], cpu=[3, 99], nodes=[900, 901])
        state = engine.call("nodes", ids=[900, 901])
        assert state["nodes"] == [{"status": "SWAP2CPU", "block_id": 5}, {"status": "SWAP2CPU", "block_id": 6}]
        assert blocks(caches, [5, 6]) == before
        assert "refused by kvcached" in engine.dropin_log(since=mark)
        engine.call("swap", event="SWAP2CPU", task_id="next", gpu=[5], cpu=[3], nodes=None)

    def test_the_drop_ins_obey_the_patch_and_read_no_fastdeploy_source(self, shared: Shared) -> None:
        """The drop-ins were started by the line's patched launcher, which told them the line and where its
        queue is (its Unix socket on 2.6 and develop 2026-05-20, TCP on e53f5184), and they ran on a FastDeploy
        of compiled modules only: none of its sources, no transfer manager, launcher, runner or version file."""
        engine, commit = shared.engine, shared.engine.config["commit"]
        package = Path(engine.config["model_dir"]) / "dropin" / "fastdeploy"
        files = sorted(p.relative_to(package).as_posix() for p in package.rglob("*") if p.is_file())
        assert files and all(name.endswith(".pyc") for name in files), files
        stems = {Path(name).stem for name in files}
        assert not stems & {"cache_transfer_manager", "prefix_cache_manager", "xpu_model_runner", "version"}, files
        told = next(line for line in engine.dropin_log().splitlines() if "launched by kvcached's patch" in line)
        assert f"FastDeploy {commit}: LineFacts(line='{commit}'" in told, told
        port = engine.config["queue_port"]
        socket = f"'/dev/shm/fd_task_queue_{port}.sock'" if engine.config["engine_socket"] else "None"
        assert f"queue_socket={socket}" in told, told

    def test_sleep_and_wakeup_answer_200_through_the_engines_own_waiter(self, shared: Shared) -> None:
        """The engine's control waiter (its FMQ) gets 200 from every rank for sleep and wakeup, saying that
        kvcached keeps the cache; an unknown method is still a 400 the waiter raises on."""
        engine, mark = shared.engine, shared.engine.log_mark()
        assert engine.call("control", method="sleep")["responses"] == [None, None]
        assert engine.call("control", method="wakeup")["responses"] == [None, None]
        assert "frees no memory" in engine.dropin_log(since=mark)
        assert "Unknown control method" in engine.call("control", method="nap")["error"]


def test_a_swap_in_that_cannot_happen_stops_the_engine_naming_it(daemons: DaemonFactory, tmp_path: Path) -> None:
    """A swap-in kvcached refuses is never reported done (the engine would read its GPU blocks as moved): the
    drop-in ends saying why, and the patched launcher stops the engine (SIGTERM)."""
    with engine_and_daemon(daemons, tmp_path) as (engine, _):
        engine.call("launch")
        with pytest.raises(EngineEnded) as ended:
            engine.call("swap", event="SWAP2GPU", task_id="impossible", gpu=[5], cpu=[99], nodes=None, timeout=60)
        assert ended.value.status == -15
        log = engine.dropin_log()
        assert "swap in 'impossible'" in log and "cannot be done" in log and "refused by kvcached" in log


def test_a_rank_whose_daemon_stays_away_ends_and_the_engine_stops(daemons: DaemonFactory, tmp_path: Path) -> None:
    """The daemon is stopped for good (``kvcached stop``): a swap-in waits for a daemon to adopt the memory
    until the task deadline (``KVCACHED_TASK_DEADLINE_S``), then the drop-in ends with a line saying why and
    the patched launcher stops the engine; nothing is reported done."""
    with engine_and_daemon(daemons, tmp_path, env={"KVCACHED_TASK_DEADLINE_S": "2"}) as (engine, daemon):
        engine.call("launch")
        assert daemon.stop() == 0
        with pytest.raises(EngineEnded) as ended:
            engine.call("swap", event="SWAP2GPU", task_id="stranded", gpu=[5], cpu=[1], nodes=None, timeout=60)
        assert ended.value.status == -15
        log = engine.dropin_log()
        assert "swap in 'stranded'" in log and "not done within 2s" in log


@pytest.mark.parametrize(
    ("daemon_args", "geometry", "argument"),
    [
        (["--geometry", "engine"], {"storage": "mooncake"}, "--kvcache_storage_backend"),
        (configured(blocks=48), {}, "--key_cache_shape"),
    ],
)
def test_a_mismatch_is_refused_by_name_and_stops_the_engine(
    daemons: DaemonFactory, tmp_path: Path, daemon_args: list[str], geometry: dict[str, str], argument: str
) -> None:
    """FastDeploy's store backend or geometry differs from the daemon's: the drop-ins exit 4 naming
    FastDeploy's argument (in FastDeploy's launch log) and the patched launcher stops the engine."""
    with engine_and_daemon(daemons, tmp_path, daemon_args=daemon_args, **geometry) as (engine, _):
        with pytest.raises(EngineEnded) as ended:
            engine.call("launch", timeout=120)
        assert ended.value.status == -15
        assert f"Error: {argument}:" in engine.dropin_log()


@pytest.mark.slow
def test_a_thousand_swaps_ride_through_a_restart_and_a_kill(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Acceptance: 1,000 swaps issued by FastDeploy's ``issue_swap_task`` while the operator runs ``kvcached
    restart``, a rank's worker is killed (replaced on the same memory), and the daemon is killed (-9) and
    started again, with swaps issued between each of these and after the last: every swap the engine sees
    done moved its bytes (each pair checked through the runners' views), none takes past the drop-in's task
    deadline, and the engine never sees an error (every daemon adopted the memory)."""
    progress, finished = tmp_path / "progress", tmp_path / "operator-done"
    done: list[tuple[str, int]] = []  # what the operator did, and the pairs done by then

    def pairs_done() -> int:
        return int(progress.read_text() or 0) if progress.exists() else 0

    def after(pairs: int) -> None:
        while pairs_done() < pairs:
            time.sleep(0.01)

    with engine_and_daemon(daemons, tmp_path) as (engine, daemon):
        engine.call("launch")
        args = ["--geometry", "engine", "--storage-backend", "file", "--storage-path", str(tmp_path / "store")]

        def operator() -> None:
            try:
                after(20)
                restarted = daemons.cli("restart", "--instance", daemon.instance)
                done.append((f"restart {restarted.returncode}: {restarted.stdout.strip()}", pairs_done()))
                after(done[-1][1] + 20)
                os.kill(read_status(daemon.instance)["ranks"][1]["pid"], signal.SIGKILL)
                done.append(("worker killed", pairs_done()))
                after(done[-1][1] + 30)
                daemon.kill9()
                done.append(("killed", pairs_done()))
                daemons.start(daemon.instance, ranks=2, small=False, args=args).wait_ready(60)
                done.append(("started", pairs_done()))
                after(done[-1][1] + 30)
            finally:
                finished.touch()

        thread = threading.Thread(target=operator, daemon=True)
        thread.start()
        got = engine.call("stream", pairs=500, progress=str(progress), until=str(finished), timeout=900)
        thread.join(60)
    assert [what.split(" ")[0] for what, _ in done] == ["restart", "worker", "killed", "started"], done
    assert done[0][0].startswith("restart 0") and "adopted" in done[0][0], done
    assert got["pairs"] >= 500 and got["pairs"] >= done[-1][1] + 30, (got, done)
    assert got["wrong"] == [], f"pairs whose bytes did not move: {got['wrong']}"
    assert got["slowest"] < TASK_S, got


@pytest.mark.parametrize("rank", [0, 1])
def test_a_killed_drop_in_stops_the_engine_naming_it(daemons: DaemonFactory, tmp_path: Path, rank: int) -> None:
    """``kill -9`` of a drop-in, rank 0's (which serves the group) or the stand-by's: the patched launcher's
    watcher stops the engine (SIGTERM), naming the rank and the signal, instead of leaving its swaps
    unanswered or going on unwatched."""
    with engine_and_daemon(daemons, tmp_path) as (engine, _):
        engine.call("launch")
        words = {p: Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0") for p in engine.dropins()}
        pids = {int(w[w.index(b"--rank") + 1]): p for p, w in words.items()}
        os.kill(pids[rank], signal.SIGKILL)
        with pytest.raises(EngineEnded) as ended:
            for i in range(150):
                engine.call("swap", event="SWAP2CPU", task_id=f"after-{i}", gpu=[5], cpu=[1], nodes=None, timeout=45)
                time.sleep(0.2)
        assert ended.value.status == -15
        said = engine.err.read_text()
        assert f"cache transfer manager of rank {rank} ended (killed by signal 9)" in said, said[-2000:]


def children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def test_a_read_is_reported_once_every_ranks_part_ended(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Through ``request_match_blocks``: rank 0's load fails (its store agent stopped, the store timeout 1 s)
    while rank 1's worker is stopped for 2.5 s. The engine is told nothing loaded only once rank 1's load has
    ended: the GPU blocks it recycles and computes into keep what it writes there (looked at 1.5 s after
    rank 1 continues: a load reported too early would have landed by then)."""
    prompt = list(range(5000, 5000 + 8 * BLOCK))
    args = ["--geometry", "engine", "--store-timeout", "1"]
    with engine_and_daemon(daemons, tmp_path, daemon_args=args) as (engine, daemon):
        engine.call("launch")
        caches = views(daemon.instance)
        fill(caches, list(range(40, 48)), seed=7)
        engine.call("write_decode", request_id="w", prompt=prompt, block_tables=list(range(40, 48)))
        ranks = read_status(daemon.instance)["ranks"]
        stopped = [*children(ranks[0]["pid"]), ranks[1]["pid"]]
        for pid in stopped:
            halt(pid)
        continued = time.monotonic() + 2.5
        threading.Timer(2.5, os.kill, (ranks[1]["pid"], signal.SIGCONT)).start()
        try:
            got = engine.call("match", request_id="r", prompt=prompt)
            assert got["storage_blocks"] == [] and got["tokens"] == 0
            for tensor in caches[1].key_caches + caches[1].value_caches:
                tensor[:].view("uint8")[...] = 0x77  # a new request computes into the recycled blocks
            time.sleep(max(continued + 1.5 - time.monotonic(), 0))
            assert all((t[:].view("uint8") == 0x77).all() for t in caches[1].key_caches + caches[1].value_caches)
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)


def test_a_write_is_reported_once_every_ranks_part_ended(daemons: DaemonFactory, tmp_path: Path) -> None:
    """Through ``write_cache_to_storage_decode``: rank 0's put fails at once (its object directories are
    files), rank 1's is slow (0.25 s more per object). The engine gets the write back only once rank 1's put
    has ended, so the blocks it then reuses never reach the store; the prompt written again and matched
    loads its own KV on every rank."""
    from kvcached.fastdeploy.arguments import store_key

    prompt = list(range(7000, 7000 + 4 * BLOCK))
    ids, store = [40, 41, 42, 43], tmp_path / "store"
    fault = {"KVCACHED_FAULT": "store-step:sleep=0.25"}
    args = ["--geometry", "engine", "--store-timeout", "10"]
    with engine_and_daemon(daemons, tmp_path, daemon_args=args, daemon_env=fault) as (engine, daemon):
        engine.call("launch")
        caches = views(daemon.instance)
        fill(caches, ids, seed=7)
        truth = blocks(caches, ids)
        keys = engine.call("keys", prompt=prompt)["keys"]
        planted = [store / "r0" / store_key(k, "").hex()[:2] for k in keys]
        planted = [p for p in dict.fromkeys(planted) if not p.exists()]
        for where in planted:
            where.write_text("not a directory")
        engine.call("write_decode", request_id="w1", prompt=prompt, block_tables=ids)
        fill(caches, ids, seed=99)  # the request is done: its blocks are reused
        time.sleep(1.5)  # a put still under way (1 s for its 4 objects) would store the reused blocks now
        for where in planted:
            where.unlink()
        fill(caches, ids, seed=7)
        engine.call("write_decode", request_id="w2", prompt=prompt, block_tables=ids)
        got = engine.call("match", request_id="r", prompt=prompt)
        assert got["storage_blocks"] and blocks(caches, got["storage_blocks"]) == truth


def test_a_slow_read_is_cut_off_at_its_deadline_and_the_engine_goes_on(daemons: DaemonFactory, tmp_path: Path) -> None:
    """A store that moves, slowly (1 s more per object loaded, 4 reading threads: 8 s for 32 blocks), past
    ``ReadStorageTask.timeout`` as ``request_match_blocks`` builds the task (the field's default, FastDeploy's
    30 s, set to 3 s in the engine): the read is cut off there, the engine gets the blocks loaded by then (a
    prefix, byte for byte) and goes on; the drop-in's log names the task's deadline."""
    prompt = list(range(9000, 9000 + 32 * BLOCK))
    ids = list(range(32, 64))  # the engine loads into blocks it takes off its free list: 0, 1, ...
    args = ["--geometry", "engine", "--store-timeout", "20"]
    slow = {"KVCACHED_FAULT": "load-step:sleep=1"}
    with engine_and_daemon(daemons, tmp_path, daemon_args=args, daemon_env=slow, read_timeout=3) as (engine, daemon):
        engine.call("launch")
        caches = views(daemon.instance)
        fill(caches, ids, seed=7)
        engine.call("write_decode", request_id="w", prompt=prompt, block_tables=ids)
        got = engine.call("match", request_id="r", prompt=prompt, timeout=200)
        loaded = got["storage_blocks"]
        assert 0 < len(loaded) < len(ids) and got["tokens"] == len(loaded) * BLOCK
        assert not set(loaded) & set(ids)
        assert blocks(caches, loaded) == blocks(caches, ids[: len(loaded)])
        engine.call("swap", event="SWAP2CPU", task_id="after", gpu=[63], cpu=[1], nodes=None)
        log = engine.dropin_log()
        assert "cut off at its deadline (3s)" in log and "cannot be served" not in log


@pytest.mark.slow
def test_a_paused_engine_is_waited_for_and_served_after(daemons: DaemonFactory, tmp_path: Path) -> None:
    """The engine and its queue server stopped (SIGSTOP to its process group) until both drop-ins have waited
    on it past every deadline they have (``KVCACHED_TASK_DEADLINE_S`` 2 plus ``KVCACHED_QUEUE_SLACK_S`` 1:
    3 s): the engine lives, so the drop-ins wait on, logging it, and serve it once it continues."""
    deadlines = {"KVCACHED_TASK_DEADLINE_S": "2", "KVCACHED_QUEUE_SLACK_S": "1"}
    waits_on = "is alive, so the drop-in waits on"
    with engine_and_daemon(daemons, tmp_path, env=deadlines) as (engine, _):
        engine.call("launch")
        os.killpg(engine.proc.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 60
            while not all(
                any(f"rank {rank} waiting" in line and waits_on in line for line in engine.dropin_log().splitlines())
                for rank in (0, 1)
            ):
                assert time.monotonic() < deadline, f"the drop-ins did not wait on\n{engine.diagnostics()}"
                time.sleep(0.1)
        finally:
            os.killpg(engine.proc.pid, signal.SIGCONT)
        engine.call("swap", event="SWAP2CPU", task_id="after-pause", gpu=[5], cpu=[1], nodes=None, timeout=60)
        log = engine.dropin_log()
        assert waits_on in log and "cannot be served" not in log
