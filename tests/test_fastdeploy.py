"""Drop-in FastDeploy compatibility: IPCSignal ready flags, export names and shapes, spec from its config."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import runner_client as rc
from kvcached.protocol.names import SHM_DIR
from kvcached.status import read_status
from tests.conftest import ROOT, DaemonFactory, run_runner, runner_result, wait_for_line

SMALL = rc.CacheSpec(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4)

# -- IPCSignal ------------------------------------------------------------------------------------------


class EngineSignal:
    """DOUBLE of FastDeploy's IPCSignal as its engine uses it: SharedMemory(f"{name}.{suffix}"), an int32
    [ranks] view. ``create=True`` takes FastDeploy's steps in its order (``ipc_signal.py`` lines 99-104 at
    e53f5184): ``shared_memory_exists`` (an open and a close), then ``SharedMemory(name).unlink()`` through
    a descriptor just opened, then an exclusive create; ``pause`` seconds pass between the unlink and the
    create (an engine preempted there), and ``late`` seconds between the create and the engine's initial
    write of 0 (lines 105-106)."""

    def __init__(
        self, name: str, suffix: int, ranks: int, *, create: bool, pause: float = 0.0, late: float = 0.0
    ) -> None:
        self.shm_name = f"{name}.{suffix}"
        if create:
            try:
                probe = shared_memory.SharedMemory(name=self.shm_name)
            except FileNotFoundError:
                pass
            else:
                resource_tracker.unregister(probe._name, "shared_memory")  # type: ignore[attr-defined]
                probe.close()
                shared_memory.SharedMemory(name=self.shm_name).unlink()
                time.sleep(pause)
            self.shm = shared_memory.SharedMemory(name=self.shm_name, create=True, size=4 * ranks)
        else:
            self.shm = shared_memory.SharedMemory(name=self.shm_name)
        resource_tracker.unregister(self.shm._name, "shared_memory")  # type: ignore[attr-defined]
        self.value: np.ndarray[Any, Any] = np.ndarray((ranks,), dtype=np.int32, buffer=self.shm.buf)
        if create:
            time.sleep(late)
            self.value[:] = 0

    def close(self) -> None:
        del self.value
        self.shm.close()


@pytest.fixture
def suffix(daemons: DaemonFactory) -> Iterator[int]:
    """A unique ipc suffix; its segments are removed after the test, once its daemons are stopped (a
    daemon still running would link a name removed before it back)."""
    value = 40000 + (os.getpid() * 7 + time.monotonic_ns()) % 20000
    yield value
    for daemon in daemons.daemons:  # a test that failed midway left its daemon running
        if daemon.proc.poll() is None:
            daemon.stop()
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
        restarted.wait_state("RECOVERING")  # it adopts the killed run's memory
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


def test_an_engine_preempted_inside_its_create_finds_the_name_free_and_the_flags_right(
    daemons: DaemonFactory, suffix: int
) -> None:
    """IPCSignal(create=True) opens the segment, unlinks it, creates the name exclusively, then writes its
    initial 0s: an engine preempted between the unlink and the create for up to 0.6 s still finds the
    name free (the daemon links a name a reader's exit took away back within milliseconds, but not one
    the engine is re-creating); one preempted before its initial write, after the daemon wrote the
    segment, reads 1 for every READY rank again soon after."""
    daemon = daemons.start(ranks=2, args=["--ipc-suffix", str(suffix)])
    daemon.wait_ready()
    for pause in (0.05, 0.3, 0.6):
        EngineSignal("cache_ready_signal", suffix, 2, create=True, pause=pause).close()  # FileExistsError if taken
    last = EngineSignal("cache_ready_signal", suffix, 2, create=True, pause=0.3, late=0.5)
    try:
        until(lambda: list(last.value) == [1, 1], timeout=5, what="the daemon writes into the newest segment")
        assert daemon.stop() == 0
    finally:
        last.close()


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


def _reader(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "helpers" / "fd_reader.py"), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def test_flags_cannot_strand_a_waiter(daemons: DaemonFactory, suffix: int) -> None:
    """The engine created the flags; a FastDeploy waiter waits on them; during ALLOCATING short-lived
    FastDeploy readers come and go (each one's resource tracker unlinks the name): the name comes back as
    the same segment each time and the next reader attaches; at READY both the waiter and the engine's own
    mapping read 1 within 1 s; after `kvcached stop` the engine's names still exist and read 0."""
    engine = EngineSignal("cache_ready_signal", suffix, 2, create=True)
    swap = EngineSignal("swap_space_ready_signal", suffix, 2, create=True)
    inode = (SHM_DIR / f"cache_ready_signal.{suffix}").stat().st_ino
    readers: list[subprocess.Popen[str]] = []
    try:
        daemon = daemons.start(
            ranks=2, args=["--ipc-suffix", str(suffix)], env=daemons.env(KVCACHED_FAULT="worker-before-ready:sleep=4")
        )
        daemon.wait_state("ALLOCATING")
        waiter = _reader("wait", "cache_ready_signal", suffix, 2, 1)
        readers.append(waiter)
        wait_for_line(waiter, "attached")  # waiting before the short-lived readers come and go
        public = SHM_DIR / f"cache_ready_signal.{suffix}"
        for _ in range(4):
            # A reader's exit unlinks the name (its tracker): back soon, the same segment. A reader started
            # before its tracker ran can find it gone (kvcached's flags.py says why): not asserted here.
            short = _reader("once", "cache_ready_signal", suffix, 2)
            assert short.wait(30) == 0, short.communicate()
            until(lambda: public.exists() and public.stat().st_ino == inode, timeout=3, what="the same segment")
        status = daemon.wait_ready()
        ready = time.monotonic_ns()
        out, _ = waiter.communicate(timeout=30)
        saw = int(out.strip().splitlines()[-1])
        assert saw - ready < 1e9, "the waiter saw READY more than 1 s late"
        until(lambda: list(engine.value) == [1, 1], timeout=1, what="the engine's own mapping")
        assert status["alive"] and daemon.stop() == 0
        assert (SHM_DIR / f"cache_ready_signal.{suffix}").exists(), "the engine's name is not kvcached's to unlink"
        assert list(engine.value) == [0, 0] and list(swap.value) == [0, 0]
        fresh = EngineSignal("cache_ready_signal", suffix, 2, create=False)
        assert list(fresh.value) == [0, 0]
        fresh.close()
    finally:
        for reader in readers:  # a waiter of a failed test would wait for ever
            if reader.poll() is None:
                reader.kill()
                reader.wait()
        engine.close()
        swap.close()


def test_the_engine_recreating_its_flags_never_finds_the_name_taken(daemons: DaemonFactory, suffix: int) -> None:
    """IPCSignal(create=True) unlinks the name and creates it exclusively: the daemon, which links a name
    that went away back, must leave it free for that moment. 300 re-creations in a row, none refused; the
    last segment reads 1 for every READY rank."""
    daemon = daemons.start(ranks=2, args=["--ipc-suffix", str(suffix)])
    daemon.wait_ready()
    for _ in range(300):
        signal_ = EngineSignal("cache_ready_signal", suffix, 2, create=True)  # FileExistsError if taken
        signal_.close()
    last = EngineSignal("cache_ready_signal", suffix, 2, create=True)
    try:
        until(lambda: list(last.value) == [1, 1], timeout=5, what="the daemon writes into the newest segment")
        assert daemon.stop() == 0
    finally:
        last.close()


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
            kv_lora_rank=values.get("kv_lora_rank"),
            qk_rope_head_dim=values.get("qk_rope_head_dim"),
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
        speculative_config=SimpleNamespace(
            num_extra_cache_layer=values.get("mtp", 0), num_gpu_block_expand_ratio=values.get("expand", 1.0)
        ),
    )


XPU_RUNNER = "fastdeploy/worker/xpu_model_runner.py"
GPU_RUNNER = "fastdeploy/worker/gpu_model_runner.py"
#: Lines of FastDeploy at e53f5184 the rows below were read from: (file, line, code found there).
CITES = {
    "xpu dtype": (XPU_RUNNER, 1230, "cache_type = self.model_config.dtype"),
    "xpu quant": (XPU_RUNNER, 1237, 'cache_type = "int8"'),
    "xpu shape": (
        "fastdeploy/model_executor/layers/backends/xpu/attention.py",
        154,
        "key_cache_shape = value_cache_shape = [max_num_blocks, self.kv_num_heads, self.block_size, self.head_dim]",
    ),
    "xpu names": (XPU_RUNNER, 1266, 'key_cache_name = f"key_caches_{i}_rank{local_rank}.device{self.device_id}"'),
    "xpu key and value only": (XPU_RUNNER, 1274, "set_data_ipc(val_cache, val_cache_name)"),
    "gpu dtype": (GPU_RUNNER, 1400, "cache_type = self.model_config.dtype"),
    "gpu quant": (GPU_RUNNER, 1415, 'cache_type = "uint8"'),
    "gpu shape": (
        "fastdeploy/model_executor/layers/attention/append_attn_backend.py",
        267,
        "key_cache_shape = [max_num_blocks, self.kv_num_heads, self.block_size, self.head_dim]",
    ),
    "gpu int4_zp": (
        "fastdeploy/model_executor/layers/attention/append_attn_backend.py",
        269,
        "key_cache_shape[-1] = self.head_dim // 2",
    ),
    "gpu scale shape": (
        GPU_RUNNER,
        1433,
        "kv_cache_scale_shape = [key_cache_shape[0], key_cache_shape[1], key_cache_shape[2]]",
    ),
    "gpu scale dtype": (GPU_RUNNER, 1485, "shape=kv_cache_scale_shape, fill_value=0, dtype=paddle.get_default_dtype()"),
    "default dtype is the model's": (
        "fastdeploy/cache_manager/prefix_cache_manager.py",
        321,
        "--default_dtype '{self.config.model_config.dtype}'",
    ),
    "gpu names": (
        GPU_RUNNER,
        1458,
        'key_cache_scales_name = f"key_cache_scales_{i}_rank{local_rank}.device{self.device_id}"',
    ),
    "mla shape": (
        "fastdeploy/model_executor/layers/attention/mla_attention_backend.py",
        398,
        "key_cache_shape = [max_num_blocks, 1, self.block_size, self.kv_lora_rank + self.qk_rope_head_dim]",
    ),
    "mla key only": (
        "fastdeploy/model_executor/layers/attention/mla_attention_backend.py",
        399,
        "value_cache_shape = []",
    ),
    "mtp blocks": (
        "fastdeploy/spec_decode/mtp.py",
        216,
        "self.num_gpu_blocks = int(main_model_num_blocks * self.speculative_config.num_gpu_block_expand_ratio)",
    ),
    "mtp names": ("fastdeploy/spec_decode/mtp.py", 267, "self.num_main_model_layers,"),
    "mtp layers": ("fastdeploy/config.py", 862, "self.num_extra_cache_layer = 1"),
}


def rows(
    *layers: int,
    kinds: tuple[str, ...] = ("key_caches", "value_caches"),
    shapes: dict[str, Any],
    dtypes: dict[str, str],
) -> list[tuple[str, tuple[int, ...], str]]:
    """The expected exports of local rank 1 on device 1: per layer, each kind's name, shape and dtype."""
    return [(f"{kind}_{i}_rank1.device1", shapes[kind], dtypes[kind]) for i in layers for kind in kinds]


KV, SCALE = (100, 2, 64, 128), (100, 2, 64)
BF16 = {"key_caches": "bfloat16", "value_caches": "bfloat16"}
FP16 = {"key_caches": "float16", "value_caches": "float16"}
SCALES = ("key_caches", "value_caches", "key_cache_scales", "value_cache_scales")
#: (case, platform, config changes, expected exports, the lines they were read from). 2 layers, 8 KV heads at
#: TP 4 (2 a rank), head_dim 128, block_size 64, 100 blocks, local rank 1 on device 1.
REFERENCE: list[tuple[str, str, dict[str, Any], list[Any], tuple[str, ...]]] = [
    ("xpu bf16", "xpu", {}, rows(0, 1, shapes={"key_caches": KV, "value_caches": KV}, dtypes=BF16),
     ("xpu dtype", "xpu shape", "xpu names", "xpu key and value only")),
    ("xpu fp16", "xpu", {"dtype": "float16"},
     rows(0, 1, shapes={"key_caches": KV, "value_caches": KV}, dtypes=FP16),
     ("xpu dtype",)),
    ("xpu int8", "xpu", {"quant": "int8"},
     rows(0, 1, shapes={"key_caches": KV, "value_caches": KV}, dtypes={"key_caches": "int8", "value_caches": "int8"}),
     ("xpu quant",)),
    ("xpu block_wise_fp8: int8, no scale tensors", "xpu", {"quant": "block_wise_fp8"},
     rows(0, 1, shapes={"key_caches": KV, "value_caches": KV}, dtypes={"key_caches": "int8", "value_caches": "int8"}),
     ("xpu quant", "xpu key and value only")),
    ("gpu bf16", "gpu", {}, rows(0, 1, shapes={"key_caches": KV, "value_caches": KV}, dtypes=BF16),
     ("gpu dtype", "gpu shape", "gpu names")),
    ("gpu int8: uint8", "gpu", {"quant": "int8"},
     rows(0, 1, shapes={"key_caches": KV, "value_caches": KV}, dtypes={"key_caches": "uint8", "value_caches": "uint8"}),
     ("gpu quant",)),
    ("gpu block_wise_fp8: uint8, scales in the model dtype", "gpu", {"quant": "block_wise_fp8"},
     rows(0, 1, kinds=SCALES, shapes={"key_caches": KV, "value_caches": KV, "key_cache_scales": SCALE,
                                      "value_cache_scales": SCALE},
          dtypes={"key_caches": "uint8", "value_caches": "uint8", "key_cache_scales": "bfloat16",
                  "value_cache_scales": "bfloat16"}),
     ("gpu quant", "gpu scale shape", "gpu scale dtype", "default dtype is the model's", "gpu names")),
    ("gpu int4_zp: two values a byte", "gpu", {"quant": "int4_zp"},
     rows(0, 1, shapes={"key_caches": (100, 2, 64, 64), "value_caches": (100, 2, 64, 64)},
          dtypes={"key_caches": "uint8", "value_caches": "uint8"}),
     ("gpu quant", "gpu int4_zp")),
    ("gpu MLA, DeepSeek-like at TP8: key only, 576 wide", "gpu",
     {"mla": True, "tp": 8, "kv_heads": 128, "head_dim": 192, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
     rows(0, 1, kinds=("key_caches",), shapes={"key_caches": (100, 1, 64, 576)}, dtypes={"key_caches": "bfloat16"}),
     ("mla shape", "mla key only")),
    ("xpu MTP: one extra layer with the expanded block count", "xpu", {"mtp": 1, "expand": 1.5},
     rows(0, 1, shapes={"key_caches": KV, "value_caches": KV}, dtypes=BF16)
     + rows(2, shapes={"key_caches": (150, 2, 64, 128), "value_caches": (150, 2, 64, 128)}, dtypes=BF16),
     ("mtp blocks", "mtp names", "mtp layers")),
    ("gpu MTP", "gpu", {"mtp": 1},
     rows(0, 1, 2, shapes={"key_caches": KV, "value_caches": KV}, dtypes=BF16),
     ("mtp names", "mtp layers")),
]  # fmt: skip


@pytest.mark.parametrize(("case", "platform", "changes", "expected", "cited"), REFERENCE, ids=[r[0] for r in REFERENCE])
def test_export_names_shapes_dtypes_match_fastdeploy(
    case: str, platform: str, changes: dict[str, Any], expected: list[Any], cited: tuple[str, ...]
) -> None:
    """Each case as FastDeploy's runner lays it out, written out by hand from the cited lines; with
    FASTDEPLOY_SRC naming a checkout of e53f5184, each cited line is read there and must hold that code."""
    changes = dict(changes)
    mla = changes.pop("mla", False)
    spec = rc.spec_from_fastdeploy(fd_config(cpu=16, **changes), 1, mla=mla, platform=platform)
    got = [(e.name, e.shape, e.dtype) for e in rc.exports(spec, local_rank=1, device_id=1)]
    assert got == expected
    source = os.environ.get("FASTDEPLOY_SRC")
    for name in cited:
        path, line, code = CITES[name]
        assert path and line and code
        if source:
            text = (Path(source) / path).read_text().splitlines()[line - 1]
            assert code in text, f"{path}:{line} no longer reads {code!r}: {text!r}"


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
    with pytest.raises(rc.InvalidArgument) as info:
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
