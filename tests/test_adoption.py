"""The cache outlives its processes: a start adopts the memory an earlier run left, runners ride through
a kill -9 and a restart, the CPU pool is found again by key, and adoption is refused when it must be.

Everything is real: daemon processes killed with SIGKILL, ``kvcached restart`` executing itself, runner
processes holding their views across it, sha256 of the very shared memory objects.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import posix_ipc
import pytest
import xxhash

import runner_client as rc
from kvcached.protocol.control import HEADER_SIZE, RECORD_SIZE
from kvcached.protocol.names import SHM_DIR, control_name
from kvcached.status import read_status
from runner_client.tasks import FOLLOW_S
from tests.conftest import ROOT, Daemon, DaemonFactory, shm_entries, unique_devices, unique_instance
from tests.helpers.procs import halt


def geometry(spec: rc.CacheSpec) -> list[str]:
    """``kvcached start`` flags for ``spec``."""
    return [
        "--num-layers", str(spec.num_layers), "--kv-heads", str(spec.kv_heads), "--head-dim", str(spec.head_dim),
        "--block-size", str(spec.block_size), "--num-blocks", str(spec.num_blocks),
        "--num-cpu-blocks", str(spec.num_cpu_blocks),
    ]  # fmt: skip


SPEC = rc.CacheSpec(num_layers=4, kv_heads=2, head_dim=32, block_size=16, num_blocks=64, num_cpu_blocks=64)
#: 2 ranks x 1 GiB (device 768 MiB, CPU pool 256 MiB each): a start that adopts this must still be quick.
GIB_SPEC = rc.CacheSpec(num_layers=4, kv_heads=2, head_dim=128, block_size=64, num_blocks=3072, num_cpu_blocks=1024)


class RunnerProcess:
    """``tests/helpers/adoption_runner.py``: a runner process answering one JSON line per command."""

    def __init__(self, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "helpers" / "adoption_runner.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
        )

    def ask(self, do: str, **command: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"do": do, **command}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"runner exited ({self.proc.poll()}): {self.proc.stderr.read() if self.proc.stderr else ''}"
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def memory_digests(instance: str) -> dict[str, str]:
    """A digest (xxh3-128) of every device arena, CPU pool and key directory of ``instance``, by name: fast
    enough that the runners of a killed daemon still wait for the next one while it is taken (sha256 of the
    2 GiB took longer than their 10 s on a loaded host)."""
    digests = {}
    for name in shm_entries(instance):
        if name.endswith((".dev", ".cpu", ".keys")):
            shm = posix_ipc.SharedMemory(f"/{name}", read_only=True)
            size = os.fstat(shm.fd).st_size
            with mmap.mmap(shm.fd, size, prot=mmap.PROT_READ) as mm:
                digests[name] = xxhash.xxh3_128(mm).hexdigest()
            shm.close_fd()
    return digests


def wait_ready_after(daemon: Daemon, started: float, timeout: float = 60) -> float:
    """Seconds from ``started`` until every rank of ``daemon`` is READY."""
    daemon.wait_ready(timeout)
    return time.monotonic() - started


def test_kill9_while_two_runners_swap_then_start_adopts(daemons: DaemonFactory) -> None:
    """Acceptance 1: kill -9 of the daemon while two runner processes are attached and swapping, then
    `kvcached start`: every rank READY (time printed), every device tier and CPU pool byte for byte what it
    was (the swaps write the same bytes again and again, so a task cut off changed nothing), both runners'
    views read their patterns, and their next swap succeeds without re-attaching. A task cut off at the kill
    ends TaskLost; DaemonGone only where the start was READY after the runners stopped following (FOLLOW_S)."""
    daemon = daemons.start(ranks=2, args=geometry(GIB_SPEC), small=False)
    first = daemon.wait_ready(timeout=120)
    runners = [RunnerProcess(daemons.env()) for _ in range(2)]
    try:
        blocks, cpu = list(range(0, 64)), list(range(100, 164))
        for rank, runner in enumerate(runners):
            assert runner.ask("attach", spec=GIB_SPEC.to_dict(), rank=rank, instance=daemon.instance)["ok"]
            runner.ask("fill", blocks=blocks, seed=rank)
            assert runner.ask("loop", src=blocks, cpu=cpu)["first"], "the first swap did not complete"
        time.sleep(0.3)  # both are swapping now, every swap writing what the first one wrote
        daemon.kill9()
        killed = time.monotonic()
        before = memory_digests(daemon.instance)
        started = time.monotonic()
        second = daemons.start(daemon.instance, ranks=2, args=geometry(GIB_SPEC), small=False)
        took = wait_ready_after(second, started)
        # READY later than the runners follow a daemon (a loaded host): a task then may end DaemonGone
        late = time.monotonic() - killed > FOLLOW_S - 1
        print(f"\n2 ranks x 1 GiB: READY {took:.2f} s after `kvcached start` (adopting)")
        status = read_status(daemon.instance)
        assert status["adopted_from"] == first["generation"] and "adopted from" in status["note"]
        assert memory_digests(daemon.instance) == before, "adoption changed the memory"
        for rank, runner in enumerate(runners):
            report = runner.ask("unloop")
            assert report["done"] > 0, report
            for failure in report["failures"]:  # a task in flight at the kill: TaskLost naming its blocks
                if not (late and failure["type"] == "DaemonGone"):
                    assert failure["type"] == "TaskLost" and failure["blocks"] == cpu, failure
                    assert "the daemon died" in failure["error"], "a daemon's death told as a worker's"
            assert runner.ask("check", blocks=blocks, seed=rank)["ok"], "a runner's view changed"
            assert runner.ask("valid") == {"ok": True, "valid": True, "generation": status["generation"]}
            assert runner.ask("swap_in", cpu=cpu[:8], dst=list(range(200, 208)))["blocks"] == 8
            moved = runner.ask("check", blocks=list(range(200, 208)), seed=rank, sources=blocks[:8])
            assert moved["ok"], f"rank {rank}: the swap after the restart moved other bytes: {moved}"
        assert took < 30, "adoption hung"
    finally:
        for runner in runners:
            runner.close()


def test_restart_under_a_stream_of_swaps_loses_nothing(daemons: DaemonFactory) -> None:
    """Acceptance 2: `kvcached restart` three times under a steady stream of swap tasks whose bytes are
    checked: every task succeeds or raises, no byte is lost, the longest gap in service is printed."""
    daemon = daemons.start(ranks=2, args=geometry(SPEC), small=False)
    daemon.wait_ready()
    pid = daemon.pid
    cache = rc.initialize_kv_cache(SPEC, 0, instance=daemon.instance, timeout=10)
    tasks = rc.CacheTasks(daemon.instance, timeout=30)
    raw = cache.key_caches[0].view(np.uint8)
    rng = np.random.default_rng(5)
    stop = threading.Event()
    outcome: dict[str, Any] = {"done": 0, "errors": [], "wrong": 0, "gap": 0.0}

    def stream() -> None:
        last = time.monotonic()
        i = 0
        while not stop.is_set():
            src, cpu, dst = i % 16, i % 32, 32 + i % 16
            raw[src] = rng.integers(0, 256, raw[src].shape, dtype=np.uint8)
            expected = raw[src].copy()
            try:
                tasks.swap_out(0, [src], [cpu])
                tasks.swap_in(0, [cpu], [dst])
                outcome["done"] += 1
                if not np.array_equal(raw[dst], expected):
                    outcome["wrong"] += 1
            except rc.KVCacheError as exc:
                outcome["errors"].append(repr(exc))
            now = time.monotonic()
            outcome["gap"] = max(outcome["gap"], now - last)
            last, i = now, i + 1

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        time.sleep(0.3)
        generations = []
        for _ in range(3):
            done = outcome["done"]
            result = daemons.cli("restart", "--instance", daemon.instance)
            assert result.returncode == 0, result.stdout + result.stderr
            assert "adopted from generation" in result.stdout
            generations.append(read_status(daemon.instance)["generation"])
            time.sleep(0.2)
            assert outcome["done"] > done, "no task ran across the restart"
    finally:
        stop.set()
        thread.join(60)
    print(f"\n3 restarts under a swap stream: {outcome['done']} round trips, longest gap {outcome['gap']:.3f} s")
    assert outcome["wrong"] == 0, "a swap moved wrong bytes"
    assert all("TaskLost" in error for error in outcome["errors"]), outcome["errors"]
    assert len(set(generations)) == 3 and read_status(daemon.instance)["pid"] == pid, "restart keeps the pid"
    assert cache.still_valid() and cache.daemon_alive()
    tasks.close()
    cache.close()
    assert daemon.stop() == 0
    assert shm_entries(daemon.instance) == []


def worker_pids(instance: str) -> list[int]:
    return [int(rank["pid"]) for rank in read_status(instance)["ranks"]]


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited and been reaped (no zombie left behind)."""
    return not Path(f"/proc/{pid}").exists()


def test_restart_past_a_frozen_worker_of_the_last_image(daemons: DaemonFactory) -> None:
    """A worker of the image before the restart that is frozen (SIGSTOP) cannot drain: it is killed after
    its grace (--stop-timeout, 1 s here), and the new worker takes its rank over on the same bytes; the others
    hand over at once."""
    daemon = daemons.start(ranks=2, args=geometry(SPEC), small=False, stop_timeout=1)
    daemon.wait_ready()
    cache = rc.initialize_kv_cache(SPEC, 1, instance=daemon.instance, timeout=10)
    cache.key_caches[0][7] = 9
    frozen, other = worker_pids(daemon.instance)
    halt(frozen)
    result = daemons.cli("restart", "--instance", daemon.instance)
    assert result.returncode == 0 and "adopted from generation" in result.stdout, result.stdout + result.stderr
    assert "did not drain" in daemon.log() and "handing the rank over" in daemon.log()
    deadline = time.monotonic() + 10
    while not (gone(frozen) and gone(other)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(frozen) and gone(other), "a worker of the last image is left running (or a zombie)"
    assert set(worker_pids(daemon.instance)).isdisjoint({frozen, other})
    tasks = rc.CacheTasks(daemon.instance, timeout=30)
    tasks.swap_out(1, [7], [3])
    tasks.swap_in(1, [3], [8])
    assert int(cache.key_caches[0][8].min()) == 9 and cache.still_valid()
    tasks.close()
    cache.close()
    assert daemon.stop() == 0
    assert shm_entries(daemon.instance) == []


def test_a_configuration_changed_after_the_restarts_check_keeps_the_memory(
    daemons: DaemonFactory, tmp_path: Path
) -> None:
    """The configuration file changed after `kvcached restart` checked the next image (which refuses a
    changed geometry up front) and before the exec: the new image would not adopt the memory, so it ends
    (exit 4, which the systemd unit does not restart) keeping it, as a crash leaves it, saying why; a start
    with the configuration the memory was made with adopts it, every byte as it was."""
    from tests.test_kill_steps import digests, fill
    from tests.test_restart_faults import restart_cli, wait_for_preflight

    config = tmp_path / "kv.toml"
    config.write_text("num_layers = 4\nkv_heads = 2\nhead_dim = 32\nblock_size = 16\nnum_blocks = 64\n")
    args = ["--config", str(config), "--num-cpu-blocks", "64"]
    env = daemons.env(KVCACHED_FAULT="restart-accepted:sleep=2")
    daemon = daemons.start(ranks=2, args=args, small=False, env=env)
    old = daemon.wait_ready()
    fill(daemon.instance, seed=7)
    before = digests(daemon.instance)
    restarting = restart_cli(daemons, daemon.instance)
    wait_for_preflight(daemon.pid)
    wait_for_preflight(daemon.pid, gone=True)  # checked: the restart is accepted, the exec 2 s away
    config.write_text(config.read_text().replace("num_blocks = 64", "num_blocks = 32"))
    out, _ = restarting.communicate(timeout=60)
    assert restarting.returncode != 0, out
    assert daemon.exit_code(30) == 4
    assert "restart refused: the memory would not be adopted" in daemon.log() and "The memory is kept" in daemon.log()
    assert "reclaim" not in daemon.log().split("restart-accepted")[-1], "the refused memory was reclaimed"
    assert digests(daemon.instance) == before, "the memory changed"
    config.write_text(config.read_text().replace("num_blocks = 32", "num_blocks = 64"))
    again = daemons.start(daemon.instance, ranks=2, args=args, small=False)
    status = again.wait_ready()
    assert status["adopted_from"] == old["generation"], status["note"]
    assert digests(daemon.instance) == before
    assert again.stop() == 0
    assert shm_entries(daemon.instance) == []


def test_a_new_runner_process_finds_a_prefix_in_the_cpu_pool_by_key(daemons: DaemonFactory) -> None:
    """Acceptance 3 (store off): one runner process swaps 64 blocks out with their keys and exits; the
    daemon is killed and started again (it adopts); a new runner process, knowing no block id, finds the
    64-block prefix with lookup, loads it, and the bytes match. A CPU block overwritten without keys
    leaves the directory: lookup stops before it."""
    spec = rc.CacheSpec(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=160, num_cpu_blocks=96)
    daemon = daemons.start(ranks=2, args=geometry(spec), small=False)
    daemon.wait_ready()
    tokens, out, cpu = 64 * 4, list(range(10, 74)), list(range(30, 94))
    first = RunnerProcess(daemons.env())
    try:
        assert first.ask("attach", spec=spec.to_dict(), rank=0, instance=daemon.instance)["ok"]
        first.ask("fill", blocks=out, seed=9)
        assert first.ask("keys", tokens=tokens, out=out, cpu=cpu)["blocks"] == 64
    finally:
        first.close()
    daemon.kill9()
    again = daemons.start(daemon.instance, ranks=2, args=geometry(spec), small=False)
    again.wait_ready()
    second = RunnerProcess(daemons.env())
    try:
        assert second.ask("attach", spec=spec.to_dict(), rank=0, instance=daemon.instance)["ok"]
        dst = list(range(80, 144))
        assert second.ask("lookup_load", tokens=tokens, dst=dst) == {"ok": True, "found": 64, "loaded": 64}
        assert second.ask("check", blocks=dst, seed=9, sources=out)["ok"], "loaded bytes differ"
        with rc.CacheTasks(daemon.instance) as tasks:
            tasks.swap_out(None, [0], [cpu[40]])  # block 40 of the prefix is overwritten, without a key
            keys = rc.block_keys(list(range(tokens)), spec.block_size)
            assert tasks.lookup(keys) == 40
            with pytest.raises(rc.InvalidTask, match="no attention store"):
                tasks.store(None, [1], keys[:1])
    finally:
        second.close()


def corrupt_record(instance: str, rank: int) -> None:
    """Make ``rank``'s record read as torn: its seq odd, as a writer killed mid-write leaves it."""
    shm = posix_ipc.SharedMemory(control_name(instance))
    with mmap.mmap(shm.fd, HEADER_SIZE + RECORD_SIZE * (rank + 1)) as mm:
        offset = HEADER_SIZE + RECORD_SIZE * rank
        (seq,) = struct.unpack_from("<Q", mm, offset)
        struct.pack_into("<Q", mm, offset, seq | 1)
    shm.close_fd()


@pytest.mark.parametrize("why", ["spec", "torn", "foreign"])
def test_adoption_refused_is_logged_shown_and_trusts_nothing(daemons: DaemonFactory, why: str) -> None:
    """Acceptance 4: a different spec, a record torn mid-write, an object owned by another uid: the start
    allocates anew (nothing old is used: new arena names, zeroed memory), logs why and `status` says so;
    a runner's old views are no longer valid. The foreign object is left untouched."""
    if why == "foreign" and os.geteuid() != 0:
        pytest.skip("needs root to give an object to another user")
    daemon = daemons.start(ranks=2, args=geometry(SPEC), small=False)
    first = daemon.wait_ready()
    cache = rc.initialize_kv_cache(SPEC, 1, instance=daemon.instance, timeout=10)
    cache.key_caches[0][3] = 9
    daemon.kill9()
    foreign = None
    if why == "torn":
        corrupt_record(daemon.instance, 1)
    elif why == "foreign":
        (foreign,) = [SHM_DIR / n for n in shm_entries(daemon.instance) if n.endswith(".r1.cpu")]
        os.chown(foreign, 64011, 64011)
    args = geometry(SPEC) + (["--num-blocks", "65"] if why == "spec" else [])
    second = daemons.start(daemon.instance, ranks=2, args=args, small=False)
    status = second.wait_ready()
    reason = {"spec": "num_blocks was 64", "torn": "rank 1's record is torn", "foreign": "owned by uid 64011"}[why]
    assert reason in status["note"] and status["note"].startswith("did not adopt"), status["note"]
    assert reason in second.log() and "not adopting" in second.log()
    old = [name for name in shm_entries(daemon.instance) if first["generation"] in name]
    assert status["adopted_from"] is None and old == ([foreign.name] if foreign else []), old
    assert not cache.still_valid(), "a view of the old memory passed for the new daemon's"
    if why != "spec":
        fresh = rc.initialize_kv_cache(SPEC, 1, instance=daemon.instance, timeout=10)
        assert int(fresh.key_caches[0][3].max()) == 0, "the new memory is not fresh"
        fresh.close()
    table = daemons.cli("status", "--instance", daemon.instance).stdout
    assert "did not adopt" in table
    cache.close()
    assert second.stop() == 0
    if foreign is not None:
        assert foreign.exists() and foreign.stat().st_uid == 64011, "the foreign object was touched"
        foreign.unlink()


def test_stop_keep_then_start_adopts_and_a_waiting_runner_attaches(daemons: DaemonFactory) -> None:
    """`kvcached stop --keep` leaves the ranks KEPT (status says so) and the memory in place, and says the start
    command that adopts it (the daemon's own options); a runner that
    waits meanwhile attaches to the generation that adopts it, and sees the bytes; `--fresh` reclaims."""
    daemon = daemons.start(ranks=2, args=geometry(SPEC), small=False, executed=True)  # (its own command line)
    daemon.wait_ready()
    cache = rc.initialize_kv_cache(SPEC, 0, instance=daemon.instance, timeout=10)
    cache.key_caches[1][5] = 3
    result = daemons.cli("stop", "--keep", "--instance", daemon.instance)
    assert result.returncode == 0 and "kept" in result.stdout, result
    said = f"kvcached start --instance {daemon.instance} --log-format json --ranks 2 {' '.join(geometry(SPEC))}"
    assert f"same options and KVCACHED_* variables to adopt ({said}" in result.stdout, result.stdout  # the way back
    assert daemon.exit_code() == 0
    kept = read_status(daemon.instance)
    assert not kept["alive"] and {r["state"] for r in kept["ranks"]} == {"KEPT"}
    assert "memory kept" in daemons.cli("status", "--instance", daemon.instance).stdout
    waiter = RunnerProcess(daemons.env())
    try:
        answers: list[dict[str, Any]] = []
        attach = threading.Thread(
            target=lambda: answers.append(waiter.ask("attach", spec=SPEC.to_dict(), rank=0, instance=daemon.instance))
        )
        attach.start()
        time.sleep(0.5)
        assert not answers, "a runner attached to a daemon that had stopped"
        again = daemons.start(daemon.instance, ranks=2, args=geometry(SPEC), small=False)
        status = again.wait_ready()
        attach.join(30)
        assert answers and answers[0] == {"ok": True, "generation": status["generation"]}, answers
        assert "kept by its daemon" in status["note"]
        assert int(cache.key_caches[1][5].max()) == 3 and cache.still_valid()
    finally:
        waiter.close()
    # --fresh: nothing is adopted.
    assert daemons.cli("stop", "--keep", "--instance", daemon.instance).returncode == 0
    assert again.exit_code() == 0
    fresh = daemons.start(daemon.instance, ranks=2, args=[*geometry(SPEC), "--fresh"], small=False)
    assert fresh.wait_ready()["note"] == "did not adopt the memory: --fresh"
    assert not cache.still_valid()
    cache.close()


def test_xpu_device_tier_is_made_anew_while_the_pool_and_keys_are_adopted(daemons: DaemonFactory) -> None:
    """The xpu backend (over the TEST DOUBLE of its runtime): device memory dies with its process, so an
    adopting daemon makes the device tier anew (a new descriptor: runners must re-attach, and CacheTasks
    says so), while the CPU pool and its key directory are adopted byte for byte."""
    pytest.importorskip("paddle")
    env = daemons.env(KVCACHED_PLUGINS="tests.plugins.xpu_double")
    args = ["--memory", "xpu-double", "--devices", str(unique_devices(1)[0]), *geometry(SPEC)]
    daemon = daemons.start(ranks=1, args=args, small=False, env=env)
    first = daemon.wait_ready()
    tasks = rc.CacheTasks(daemon.instance)
    keys = rc.block_keys(list(range(8 * SPEC.block_size)), SPEC.block_size)
    tasks.swap_out(0, list(range(8)), list(range(8)), keys=keys)
    pools = {n: d for n, d in memory_digests(daemon.instance).items() if not n.endswith(".dev")}
    daemon.kill9()
    again = daemons.start(daemon.instance, ranks=1, args=args, small=False, env=env)
    status = again.wait_ready()
    assert status["adopted_from"] == first["generation"]
    assert memory_digests(daemon.instance) == pools, "the CPU pool or its key directory changed"
    with pytest.raises(rc.DaemonGone, match="made this rank's memory anew"):
        tasks.swap_out(0, [1], [1])
    tasks.close()
    with rc.CacheTasks(daemon.instance) as fresh:
        assert fresh.lookup(keys) == 8, "the key directory was not adopted"


def test_leftover_objects_are_reclaimed_by_a_fresh_stop(daemons: DaemonFactory) -> None:
    """Kill -9 loops with adoption in between still end with nothing in /dev/shm after a stop without
    --keep; an adopted generation's arenas keep their first names through every adoption."""
    instance = unique_instance()
    names: set[str] = set()
    for _ in range(5):
        daemon = daemons.start(instance, ranks=2)
        daemon.wait_ready()
        names.add(",".join(n for n in shm_entries(instance) if n.endswith((".dev", ".cpu", ".keys"))))
        daemon.kill9()
    assert len(names) == 1, f"adoption renamed the memory: {names}"
    last = daemons.start(instance, ranks=2)
    last.wait_ready()
    assert last.stop() == 0
    assert shm_entries(instance) == []
    assert not Path(daemons.run_dir, f"{instance}.r0.sock").exists()


def test_the_spec_difference_adoption_reads_names_mtp_fields_and_reads_an_older_spec_as_without_them() -> None:
    """Adoption's spec comparison (the spec's own ``first_difference`` over every field): a change of the MTP
    fields, the role or the store is named with both values; a spec an earlier release wrote without the
    MTP fields reads as without MTP layers, so it is the same spec."""
    from kvcached.daemon.adopt import spec_difference
    from kvcached.protocol.spec import CacheSpec

    spec = CacheSpec(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4)
    published = spec.to_dict()
    assert spec_difference(published, spec) == ""
    older = {k: v for k, v in published.items() if k not in ("mtp_layers", "mtp_num_blocks")}
    assert spec_difference(older, spec) == ""
    with_mtp = CacheSpec(**{**published, "mtp_layers": 1})
    assert spec_difference(published, with_mtp) == "the spec differs: mtp_layers was 0, this configuration has 1"
    assert "mtp_num_blocks was 0" in spec_difference(published, CacheSpec(**{**published, "mtp_num_blocks": 16}))
    assert "splitwise_role was 'mixed'" in spec_difference(
        published, CacheSpec(**{**published, "splitwise_role": "decode"})
    )
    assert "storage_backend was None" in spec_difference(
        published, CacheSpec(**{**published, "storage_backend": "file"})
    )
