"""Drop-in FastDeploy compatibility: IPCSignal ready flags, export names and shapes, spec from its config."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker, shared_memory
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import runner_client as rc
from kvcached.protocol.names import SHM_DIR
from kvcached.status import read_status
from tests.conftest import DaemonFactory, run_runner, runner_result

SMALL = rc.CacheSpec(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4)

# -- IPCSignal ------------------------------------------------------------------------------------------


class EngineSignal:
    """FastDeploy's IPCSignal as its engine uses it: SharedMemory(f"{name}.{suffix}"), an int32 [ranks] view."""

    def __init__(self, name: str, suffix: int, ranks: int, *, create: bool) -> None:
        self.shm_name = f"{name}.{suffix}"
        if create:  # IPCSignal(create=True) unlinks an existing segment and recreates it
            try:
                old = shared_memory.SharedMemory(name=self.shm_name)
                old.close()
                old.unlink()
            except FileNotFoundError:
                pass
            self.shm = shared_memory.SharedMemory(name=self.shm_name, create=True, size=4 * ranks)
        else:
            self.shm = shared_memory.SharedMemory(name=self.shm_name)
        resource_tracker.unregister(self.shm._name, "shared_memory")  # type: ignore[attr-defined]
        self.value: np.ndarray[Any, Any] = np.ndarray((ranks,), dtype=np.int32, buffer=self.shm.buf)
        if create:
            self.value[:] = 0

    def close(self) -> None:
        del self.value
        self.shm.close()


@pytest.fixture
def suffix() -> Iterator[int]:
    """A unique ipc suffix; its segments are removed after the test."""
    value = 40000 + (os.getpid() * 7 + time.monotonic_ns()) % 20000
    yield value
    for name in ("cache_ready_signal", "swap_space_ready_signal"):
        (SHM_DIR / f"{name}.{value}").unlink(missing_ok=True)


def until(check: Callable[[], bool], timeout: float = 20, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.01)


def test_engine_created_flags_follow_ready_through_kill9_and_restart(daemons: DaemonFactory, suffix: int) -> None:
    """The engine creates the flags first; the daemon attaches. 1 exactly while READY; a stale 1 of a
    killed run is 0 again before the restarted daemon's ranks are READY; 0 after stop."""
    cache = EngineSignal("cache_ready_signal", suffix, 2, create=True)
    swap = EngineSignal("swap_space_ready_signal", suffix, 2, create=True)
    try:
        cache.value[:] = 1  # what a killed run would have left
        slow = daemons.env(KVCACHED_FAULT="worker-before-ready:sleep=1")
        args = ["--ipc-suffix", str(suffix)]
        daemon = daemons.start(ranks=2, args=args, env=slow)
        daemon.wait_state("ALLOCATING")
        assert list(cache.value) == [0, 0], "a stale 1 is visible while the ranks allocate"
        daemon.wait_ready()
        until(lambda: list(cache.value) == [1, 1] and list(swap.value) == [1, 1], what="flags at READY")
        daemon.kill9()
        assert list(cache.value) == [1, 1], "(nothing is left to clear them between kill -9 and restart)"
        restarted = daemons.start(daemon.instance, ranks=2, args=args, env=slow)
        restarted.wait_state("ALLOCATING")
        assert list(cache.value) == [0, 0] and list(swap.value) == [0, 0]
        restarted.wait_ready()
        until(lambda: list(cache.value) == [1, 1], what="flags at READY after restart")
        # the engine re-creates a signal (IPCSignal(create=True)) while the daemon runs
        cache.close()
        cache = EngineSignal("cache_ready_signal", suffix, 2, create=True)
        until(lambda: list(cache.value) == [1, 1], timeout=5, what="flags written into the re-created segment")
        assert restarted.stop() == 0
        assert list(cache.value) == [0, 0] and list(swap.value) == [0, 0]
        assert (SHM_DIR / f"cache_ready_signal.{suffix}").exists(), "the engine's segment is not ours to remove"
    finally:
        cache.close()
        swap.close()


def test_daemon_created_flags_and_a_replaced_worker(daemons: DaemonFactory, suffix: int) -> None:
    """No engine yet: the daemon creates both flags (what an engine attaching with create=False reads); a
    rank whose worker dies stays 1 (its memory is intact while the worker is replaced); a rank that fails
    reads 0; what the daemon created is removed when it stops."""
    daemon = daemons.start(ranks=2, args=["--ipc-suffix", str(suffix), "--num-cpu-blocks", "0", "--role", "decode"])
    status = daemon.wait_ready()
    reader = EngineSignal("cache_ready_signal", suffix, 2, create=False)
    swap = EngineSignal("swap_space_ready_signal", suffix, 2, create=False)
    try:
        until(lambda: list(reader.value) == [1, 1], what="READY flags")
        assert list(swap.value) == [0, 0], "no CPU pool: swap space is never ready"
        os.kill(status["ranks"][1]["pid"], signal.SIGKILL)
        until(lambda: read_status(daemon.instance)["ranks"][1]["pid"] != status["ranks"][1]["pid"], what="replaced")
        assert list(reader.value) == [1, 1], "the cache never went away"
        daemon.wait_ready()
        assert daemon.stop() == 0
        assert list(reader.value) == [0, 0]
    finally:
        reader.close()
        swap.close()
    assert not (SHM_DIR / f"cache_ready_signal.{suffix}").exists()
    assert not (SHM_DIR / f"swap_space_ready_signal.{suffix}").exists()


def test_too_small_engine_flags_are_a_clear_error(daemons: DaemonFactory, suffix: int) -> None:
    small = EngineSignal("cache_ready_signal", suffix, 1, create=True)
    try:
        daemon = daemons.start(ranks=2, args=["--ipc-suffix", str(suffix)])
        assert daemon.exit_code(timeout=30) == 5
        assert "--ranks match the engine's tensor-parallel size" in daemon.log()
    finally:
        small.close()


def test_bounded_wait_replaces_the_sleep_loop(daemons: DaemonFactory) -> None:
    """wait_until_ready: returns at READY, raises CacheNotReady at the deadline, DaemonGone when killed."""
    daemon = daemons.start(ranks=1, env=daemons.env(KVCACHED_FAULT="worker-before-ready:sleep=60"))
    daemon.wait_state("ALLOCATING")
    with pytest.raises(rc.CacheNotReady):
        rc.wait_until_ready(daemon.instance, 0, timeout=0.5)
    daemon.kill9()
    with pytest.raises((rc.DaemonGone, rc.CacheNotReady)):
        rc.wait_until_ready(daemon.instance, 0, timeout=2)
    fresh = daemons.start(daemon.instance, ranks=1)
    rc.wait_until_ready(fresh.instance, 0, timeout=30)
    assert read_status(fresh.instance)["ranks"][0]["state"] == "READY"


# -- names, shapes, dtypes ------------------------------------------------------------------------------


def fd_config(**changes: Any) -> SimpleNamespace:
    """A FastDeploy-like FDConfig (the attributes its runner reads)."""
    values = dict(layers=2, kv_heads=8, tp=4, head_dim=128, block_size=64, blocks=100, dtype="bfloat16")
    values.update(changes)
    return SimpleNamespace(
        model_config=SimpleNamespace(
            num_hidden_layers=values["layers"],
            num_key_value_heads=values["kv_heads"],
            head_dim=values["head_dim"],
            dtype=values["dtype"],
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=values["tp"]),
        cache_config=SimpleNamespace(
            block_size=values["block_size"],
            total_block_num=values["blocks"],
            num_cpu_blocks=values.get("cpu", 0),
            kvcache_storage_backend=values.get("backend"),
        ),
        scheduler_config=SimpleNamespace(splitwise_role=values.get("role", "mixed")),
        quant_config=SimpleNamespace(kv_cache_quant_type=values.get("quant")),
    )


#: The reference table (docs/fastdeploy.md), written out for local rank 1 on device 1, 2 layers.
KV = (100, 2, 64, 128)
SCALE = (100, 2, 64)
EXPECTED = {
    "bf16": [
        ("key_caches_0_rank1.device1", KV, "bfloat16"),
        ("value_caches_0_rank1.device1", KV, "bfloat16"),
        ("key_caches_1_rank1.device1", KV, "bfloat16"),
        ("value_caches_1_rank1.device1", KV, "bfloat16"),
    ],
    "int8": [
        ("key_caches_0_rank1.device1", KV, "int8"),
        ("value_caches_0_rank1.device1", KV, "int8"),
        ("key_caches_1_rank1.device1", KV, "int8"),
        ("value_caches_1_rank1.device1", KV, "int8"),
    ],
    "block_wise_fp8": [
        ("key_caches_0_rank1.device1", KV, "int8"),
        ("value_caches_0_rank1.device1", KV, "int8"),
        ("key_cache_scales_0_rank1.device1", SCALE, "float32"),
        ("value_cache_scales_0_rank1.device1", SCALE, "float32"),
        ("key_caches_1_rank1.device1", KV, "int8"),
        ("value_caches_1_rank1.device1", KV, "int8"),
        ("key_cache_scales_1_rank1.device1", SCALE, "float32"),
        ("value_cache_scales_1_rank1.device1", SCALE, "float32"),
    ],
    "mla": [
        ("key_caches_0_rank1.device1", KV, "bfloat16"),
        ("key_caches_1_rank1.device1", KV, "bfloat16"),
    ],
}


@pytest.mark.parametrize(
    ("case", "changes", "mla"),
    [
        ("bf16", {}, False),
        ("int8", {"quant": "int8_zp"}, False),
        ("block_wise_fp8", {"quant": "block_wise_fp8"}, False),
        ("mla", {}, True),
    ],
)
def test_export_names_shapes_dtypes_match_fastdeploy(case: str, changes: dict[str, Any], mla: bool) -> None:
    spec = rc.spec_from_fastdeploy(fd_config(cpu=16, **changes), 1, mla=mla)
    got = [(e.name, e.shape, e.dtype) for e in rc.exports(spec, local_rank=1, device_id=1)]
    assert got == EXPECTED[case]


def test_spec_from_fastdeploy_follows_the_same_condition_and_per_rank_heads() -> None:
    for changes in ({}, {"cpu": 8}, {"backend": "mooncake"}, {"role": "prefill"}):
        config = fd_config(**changes)
        spec = rc.spec_from_fastdeploy(config, 0)
        fd_creates = rc.should_create_cache(
            False,
            config.cache_config.num_cpu_blocks,
            config.cache_config.kvcache_storage_backend,
            config.scheduler_config.splitwise_role,
        )
        assert (rc.cache_owner(spec) == "runner") == fd_creates, changes
    assert rc.spec_from_fastdeploy(fd_config(kv_heads=2, tp=8), 7).kv_heads == 1, "never below 1 (FastDeploy #3717)"
    with pytest.raises(rc.InvalidSpec) as info:
        rc.spec_from_fastdeploy(fd_config(backend="attention_store"), 0)
    assert info.value.field == "kvcache_storage_backend"
    with pytest.raises(rc.InvalidSpec) as info:
        rc.spec_from_fastdeploy(fd_config(), 4)
    assert info.value.field == "local_rank"


def test_runner_attaches_with_a_spec_from_fastdeploy(daemons: DaemonFactory) -> None:
    """The spec read from a FastDeploy config attaches to a daemon started with the same geometry."""
    config = fd_config(layers=2, kv_heads=4, tp=2, head_dim=16, block_size=4, blocks=8, cpu=4)
    spec = rc.spec_from_fastdeploy(config, 1)
    geometry = ["--num-layers", "2", "--kv-heads", "2", "--head-dim", "16", "--block-size", "4"]
    daemon = daemons.start(ranks=2, small=False, args=[*geometry, "--num-blocks", "8", "--num-cpu-blocks", "4"])
    daemon.wait_ready()
    result = runner_result(run_runner(daemons.env(), spec=spec.to_dict(), rank=1, instance=daemon.instance))
    assert result["ok"] and result["owner"] == "daemon", result
