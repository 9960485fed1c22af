"""The handshake end to end: one owner per rank, a ready flag the runner can trust.

Real daemons (``kvcached start``), real runner processes (``tests/helpers/runner_proc.py``), real POSIX shm and
semaphores, real SIGKILL.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import runner_client as rc
from kvcached.protocol.layout import device_arena_bytes
from kvcached.status import read_status
from tests.conftest import (
    ROOT,
    DaemonFactory,
    run_runner,
    runner_result,
    shm_entries,
    unique_instance,
    wait_for_line,
    wait_waiting,
)

#: Matches the ``small`` geometry of DaemonFactory.start.
SMALL: dict[str, Any] = dict(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4)


def small_spec(**changes: Any) -> rc.CacheSpec:
    return rc.CacheSpec(**{**SMALL, **changes})


def daemon_args(spec: rc.CacheSpec) -> list[str]:
    return [
        "--num-cpu-blocks",
        str(spec.num_cpu_blocks),
        "--storage-backend",
        spec.storage_backend or "none",
        "--role",
        spec.splitwise_role,
    ]


def dev_arenas(instance: str, rank: int) -> list[str]:
    return [n for n in shm_entries(instance) if n.endswith(f".r{rank}.dev")]


def arena_digest(cache: rc.KVCache) -> str:
    h = hashlib.sha256()
    for t in cache.key_caches + cache.value_caches:
        h.update(np.ascontiguousarray(t).tobytes())
    return h.hexdigest()


# -- 1. the ownership matrix ---------------------------------------------------------------------------

MATRIX = list(itertools.product([0, 4], [None, "file"], ["mixed", "prefill", "decode"]))


@pytest.mark.parametrize(("cpu", "storage", "role"), MATRIX)
def test_exactly_one_device_cache_per_rank(daemons: DaemonFactory, cpu: int, storage: str | None, role: str) -> None:
    """For every configuration (x profile), exactly one device cache per rank exists across daemon and runner,
    and a daemon-owned cache is one memory: a value written by one runner is read by a second attach."""
    spec = small_spec(num_cpu_blocks=cpu, storage_backend=storage, splitwise_role=role)
    daemon = daemons.start(ranks=2, args=daemon_args(spec))
    instance = daemon.instance
    env = daemons.env()

    if rc.cache_owner(spec) == "runner":
        # The daemon refuses, citing the condition, and makes nothing; each runner allocates its own.
        assert daemon.exit_code() == 4
        assert "refusing to allocate" in daemon.log() and "create_cache_tensor" in daemon.log()
        assert shm_entries(instance) == []
        runners = [
            run_runner(env, spec=spec.to_dict(), rank=rank, instance=instance, profile=profile, timeout=5)
            for profile, rank in itertools.product([False, True], [0, 1])
        ]  # side by side: each allocates its own, whatever the others do
        for result in map(runner_result, runners):
            assert result["ok"] and result["owner"] == "runner"
            assert result["mapping"] == "", "the runner's own cache is anonymous memory, not a daemon arena"
        return

    daemon.wait_ready()
    arenas = {rank: dev_arenas(instance, rank) for rank in (0, 1)}
    for rank in (0, 1):
        assert len(arenas[rank]) == 1, f"rank {rank}: exactly one daemon arena, got {arenas[rank]}"
        size = os.stat(f"/dev/shm/{arenas[rank][0]}").st_size
        assert size == device_arena_bytes(spec)
    # The ranks side by side: first a runner of each writes, then a second attach of each reads it back
    # while a profiling runner of each is refused.
    value = {0: 1000, 1: 1001}
    request = {"spec": spec.to_dict(), "instance": instance, "timeout": 10}
    writes = {rank: {"index": 77, "value": v} for rank, v in value.items()}
    writers = {rank: run_runner(env, **request, rank=rank, write=write) for rank, write in writes.items()}
    for rank, writer in writers.items():
        first = runner_result(writer)
        assert first["ok"] and first["owner"] == "daemon"
        assert first["mapping"] == f"/dev/shm/{arenas[rank][0]}", "the runner maps the daemon's arena, allocates none"
    readers = {
        rank: (
            run_runner(env, **request, rank=rank, read={"index": 77}),
            # Profiling makes the runner allocate a temporary cache: refused while the daemon holds the rank.
            run_runner(env, spec=spec.to_dict(), rank=rank, instance=instance, profile=True),
        )
        for rank in (0, 1)
    }
    for rank, (reader, profiler) in readers.items():
        second = runner_result(reader)
        assert second["ok"] and second["read"] == value[rank]
        profiled = runner_result(profiler)
        assert not profiled["ok"] and profiled["error_type"] == "OwnershipConflict"
        assert "kvcached start --geometry engine" in profiled["error"], profiled  # the way to profile first
        assert dev_arenas(instance, rank) == arenas[rank]

    assert daemon.stop() == 0
    assert shm_entries(instance) == []
    # With no daemon holding the rank (profiling before kvcached starts), the runner owns the profile cache.
    profiled = runner_result(run_runner(env, spec=spec.to_dict(), rank=0, instance=instance, profile=True))
    assert profiled["ok"] and profiled["owner"] == "runner" and profiled["mapping"] == ""


def test_runner_with_drifted_spec_refuses_second_copy(daemons: DaemonFactory) -> None:
    """A runner whose spec says it owns the cache, while the daemon holds the rank, raises OwnershipConflict."""
    daemon = daemons.start(ranks=1)
    daemon.wait_ready()
    with pytest.raises(rc.OwnershipConflict, match="second copy") as refused:
        rc.initialize_kv_cache(small_spec(num_cpu_blocks=0), 0, instance=daemon.instance, timeout=5)
    assert "the daemon's spec" in str(refused.value) and "--geometry engine" not in str(refused.value)


# -- 2. before and after -------------------------------------------------------------------------------


def test_runner_started_before_daemon_waits_then_attaches(daemons: DaemonFactory, instance: str) -> None:
    """A runner that starts first waits (no daemon yet), then attaches once the daemon is ready."""
    runner = run_runner(daemons.env(), spec=small_spec().to_dict(), rank=1, instance=instance, timeout=60, log=True)
    wait_for_line(runner, "Waiting for cache managers")
    assert runner.poll() is None, "the runner must still be waiting"
    daemon_started_ns = time.monotonic_ns()
    daemon = daemons.start(instance, ranks=2)
    result = runner_result(runner)
    assert result["ok"] and result["owner"] == "daemon"
    assert result["returned_ns"] > daemon_started_ns, "it attached only after the daemon started"
    assert result["generation"] == daemon.wait_ready()["generation"]


def test_runner_started_after_daemon_attaches_at_once(daemons: DaemonFactory) -> None:
    """A runner that starts after the daemon is ready attaches without waiting for any slice."""
    daemon = daemons.start(ranks=2)
    status = daemon.wait_ready()
    with rc.initialize_kv_cache(small_spec(), 0, instance=daemon.instance, timeout=10) as cache:
        assert cache.owner == "daemon"
        assert f"{cache.generation:016x}" == status["generation"]
        assert cache.waited_s < 0.2  # generous: an attach to a READY rank never sleeps a slice (0.25 s)


def test_many_waiters_on_one_rank_all_wake(daemons: DaemonFactory, instance: str) -> None:
    """Several runners blocked on the same rank's semaphore all wake when it turns READY: each passes the
    post on (the turnstile). Their liveness slice is 20 s here, so a waiter the post did not reach would
    return ~20 s late instead of at once."""
    env = daemons.env()
    daemon = daemons.start(instance, ranks=1, env=daemons.env(KVCACHED_FAULT="worker-before-ready:sleep=2"))
    daemon.wait_state("ALLOCATING")
    runners = [
        run_runner(env, spec=small_spec().to_dict(), rank=0, instance=instance, timeout=60, slice_s=20.0)
        for _ in range(4)
    ]
    results = [runner_result(r) for r in runners]
    assert all(r["ok"] and r["owner"] == "daemon" for r in results), results
    assert len({r["generation"] for r in results}) == 1
    spread_s = (max(r["returned_ns"] for r in results) - min(r["returned_ns"] for r in results)) / 1e9
    assert spread_s < 5.0, "a waiter missed the post and only saw READY at the end of its slice"


# -- 3. a stale control block ----------------------------------------------------------------------------


def test_stale_ready_block_is_never_trusted(daemons: DaemonFactory) -> None:
    """After kill -9 the block still says READY, but its daemon is dead: runners wait (or time out) until a
    new daemon publishes; the new daemon adopts the memory and replaces every other stale object."""
    first = daemons.start(ranks=2)
    old_generation = first.wait_ready()["generation"]
    first.kill9()
    stale = shm_entries(first.instance)
    assert any(old_generation in n for n in stale), "kill -9 leaves the run's objects behind"
    snapshot = read_status(first.instance)
    assert snapshot["ranks"][0]["state"] == "READY" and not snapshot["alive"]

    with pytest.raises(rc.CacheNotReady, match="stale"):
        rc.initialize_kv_cache(small_spec(), 0, instance=first.instance, timeout=1.0)

    runner = run_runner(daemons.env(), spec=small_spec().to_dict(), rank=0, instance=first.instance, timeout=60)
    wait_waiting(first.instance, 0)
    assert runner.poll() is None, "a runner facing only a stale block keeps waiting"
    second = daemons.start(first.instance, ranks=2)
    new_generation = second.wait_ready()["generation"]
    result = runner_result(runner)
    assert result["ok"] and result["generation"] == new_generation != old_generation
    adopted = [n for n in shm_entries(first.instance) if old_generation in n]
    assert adopted and all(n.endswith((".dev", ".cpu", ".keys")) for n in adopted), "stale objects reclaimed"
    assert read_status(first.instance)["adopted_from"] == old_generation
    assert second.stop() == 0
    assert shm_entries(first.instance) == []


# -- 4. the daemon dies while runners wait ---------------------------------------------------------------


def test_kill9_while_waiting_raises_daemon_gone_within_2s(daemons: DaemonFactory, instance: str) -> None:
    """Runners waiting on a daemon that is SIGKILLed raise DaemonGone within 2 s of the kill."""
    daemon = daemons.start(instance, ranks=2, env=daemons.env(KVCACHED_FAULT="worker-before-ready:sleep=60"))
    daemon.wait_state("ALLOCATING")
    env = daemons.env()
    runners = [run_runner(env, spec=small_spec().to_dict(), rank=r, instance=instance, timeout=60) for r in (0, 1)]
    for rank in (0, 1):
        wait_waiting(instance, rank)
    killed_ns = time.monotonic_ns()
    daemon.kill9()
    for runner in runners:
        result = runner_result(runner, timeout=30)
        assert not result["ok"] and result["error_type"] == "DaemonGone", result
        assert (result["raised_ns"] - killed_ns) / 1e9 < 2.0
        assert instance in result["error"] and "ALLOCATING" in result["error"]
    # The next start reclaims what the killed run left.
    daemons.start(instance, ranks=2).wait_ready()


def test_clean_stop_while_waiting_raises_daemon_gone(daemons: DaemonFactory, instance: str) -> None:
    """A daemon stopped before a rank was ready makes its waiters raise DaemonGone, not wait on."""
    daemon = daemons.start(instance, ranks=1, env=daemons.env(KVCACHED_FAULT="worker-before-ready:sleep=60"))
    daemon.wait_state("ALLOCATING")
    runner = run_runner(daemons.env(), spec=small_spec().to_dict(), rank=0, instance=instance, timeout=60)
    wait_waiting(instance, 0)
    assert daemon.stop() == 0
    result = runner_result(runner)
    assert result["error_type"] == "DaemonGone"


# -- 5. timeout -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_daemon", [False, True])
def test_timeout_raises_cache_not_ready_naming_instance_rank_state(
    daemons: DaemonFactory, instance: str, with_daemon: bool
) -> None:
    """CacheNotReady comes within timeout + 0.5 s and names instance, rank and state."""
    if with_daemon:
        daemons.start(instance, ranks=2, env=daemons.env(KVCACHED_FAULT="worker-before-ready:sleep=60")).wait_state(
            "ALLOCATING"
        )
    started = time.monotonic()
    with pytest.raises(rc.CacheNotReady) as info:
        rc.initialize_kv_cache(small_spec(), 1, instance=instance, timeout=1.0)
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 1.5
    message = str(info.value)
    assert instance in message and "rank 1" in message
    expected_state = "ALLOCATING" if with_daemon else "no daemon"
    assert expected_state in message and info.value.state.startswith(expected_state)
    assert " since " in message


# -- 6. mismatch and bad input change nothing ------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "changes"),
    [
        ("kv_heads", {"kv_heads": 4}),
        ("dtype", {"dtype": "float16"}),
        ("num_blocks", {"num_blocks": 16}),
        ("num_layers", {"num_layers": 3}),
        ("mla", {"mla": True}),
        ("num_cpu_blocks", {"num_cpu_blocks": 8}),
    ],
)
def test_layout_mismatch_names_field_and_changes_nothing(
    daemons: DaemonFactory, field: str, changes: dict[str, Any]
) -> None:
    """A runner whose spec differs gets CacheLayoutMismatch naming the field; the daemon's state and the
    cache's bytes are unchanged."""
    daemon = daemons.start(ranks=2)
    before = daemon.wait_ready()
    with rc.initialize_kv_cache(small_spec(), 0, instance=daemon.instance) as cache:
        cache.key_caches[1][...] = np.arange(cache.key_caches[1].size, dtype=np.uint16).reshape(
            cache.key_caches[1].shape
        )
        digest = arena_digest(cache)
    with pytest.raises(rc.CacheLayoutMismatch) as info:
        rc.initialize_kv_cache(small_spec(**changes), 0, instance=daemon.instance, timeout=5)
    assert info.value.field == field and field in str(info.value)
    after = read_status(daemon.instance)
    assert [r["state"] for r in after["ranks"]] == ["READY", "READY"]
    assert after["generation"] == before["generation"] and after["pid"] == before["pid"]
    with rc.initialize_kv_cache(small_spec(), 0, instance=daemon.instance) as cache:
        assert arena_digest(cache) == digest


def test_bad_arguments_are_named_and_change_nothing(daemons: DaemonFactory) -> None:
    """Bad rank, framework or timeout: InvalidArgument naming the argument; a bad instance name or spec:
    InvalidSpec naming it; a rank beyond the daemon's ranks is a mismatch of num_ranks; the daemon serves on,
    unchanged."""
    daemon = daemons.start(ranks=2)
    before = daemon.wait_ready()
    bad_calls: list[tuple[str, dict[str, Any], type[rc.KVCacheError]]] = [
        ("local_rank", {"local_rank": -1}, rc.InvalidArgument),
        ("framework", {"framework": "torch"}, rc.InvalidArgument),
        ("timeout", {"timeout": -1}, rc.InvalidArgument),
        ("instance", {"instance": "../etc"}, rc.InvalidSpec),
        ("spec", {"spec": {"num_layers": 2}}, rc.InvalidSpec),
    ]
    for field, override, error in bad_calls:
        kwargs: dict[str, Any] = {"spec": small_spec(), "local_rank": 0, "instance": daemon.instance, **override}
        with pytest.raises(error) as info:
            rc.initialize_kv_cache(kwargs.pop("spec"), kwargs.pop("local_rank"), **kwargs)
        assert info.value.field == field
    with pytest.raises(rc.CacheLayoutMismatch) as mismatch:
        rc.initialize_kv_cache(small_spec(), 5, instance=daemon.instance, timeout=5)
    assert mismatch.value.field == "num_ranks"
    after = read_status(daemon.instance)
    assert after["generation"] == before["generation"]
    assert [r["state"] for r in after["ranks"]] == ["READY", "READY"]


# -- 7. two daemons, one instance ------------------------------------------------------------------------


def test_second_daemon_same_instance_exits_and_first_keeps_serving(daemons: DaemonFactory) -> None:
    """The second daemon exits non-zero with a clear message; the first's objects are untouched."""
    first = daemons.start(ranks=2)
    before = first.wait_ready()
    objects = {n: os.stat(f"/dev/shm/{n}").st_ino for n in shm_entries(first.instance)}
    second = daemons.start(first.instance, ranks=2)
    assert second.exit_code() == 3
    assert "already running" in second.log()
    assert {n: os.stat(f"/dev/shm/{n}").st_ino for n in shm_entries(first.instance)} == objects
    after = read_status(first.instance)
    assert after["generation"] == before["generation"] and after["pid"] == first.pid
    with rc.initialize_kv_cache(small_spec(), 1, instance=first.instance, timeout=5) as cache:
        assert cache.owner == "daemon"


def test_runner_thread_wait_does_not_block_other_threads(daemons: DaemonFactory, instance: str) -> None:
    """The wait blocks in the semaphore with the GIL released: other threads of the runner keep running."""
    ticks = 0
    stop = threading.Event()

    def count() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0.001)

    counter = threading.Thread(target=count)
    counter.start()
    daemons.start(instance, ranks=1, env=daemons.env(KVCACHED_FAULT="worker-before-ready:sleep=60")).wait_state(
        "ALLOCATING"
    )
    try:
        with pytest.raises(rc.CacheNotReady):
            rc.initialize_kv_cache(small_spec(), 0, instance=instance, timeout=1.0)
    finally:
        stop.set()
        counter.join()
    assert ticks > 100


def test_a_waiting_runner_has_imported_what_attaching_needs() -> None:
    """The wake-up budget is a millisecond or two: a runner imports the device backends before it waits,
    not after READY (a module's import is several milliseconds). A fresh process waiting for an instance
    that no daemon runs has them all imported while it waits."""
    code = (
        "import sys, threading, time\n"
        "import runner_client as rc\n"
        "from kvcached import memory\n"
        "spec = rc.CacheSpec(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4)\n"
        "waiter = threading.Thread(target=lambda: rc.initialize_kv_cache(spec, 0, instance=sys.argv[1], timeout=3)"
        ", daemon=True)\n"
        "assert not any(m in sys.modules for m in memory._REGISTRY.builtin.values())\n"
        "waiter.start(); time.sleep(1.0)\n"
        "print(sorted(m for m in memory._REGISTRY.builtin.values() if m not in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, unique_instance()],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
