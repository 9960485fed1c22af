"""FastDeploy's XPU runner with kvcached: profile first (FastDeploy's default), then attach, one cache.

FastDeploy profiles by default (``engine/common_engine.py`` ~235): ``profile_run`` (``xpu_model_runner.py``
~1736-1742) sets ``num_gpu_blocks`` to the configured count and calls ``initialize_kv_cache(profile=True)``;
the worker then fixes the block count from the memory left (``worker_process.py`` ~661-700) and
``update_share_input_block_num`` (~1756-1765) calls ``initialize_kv_cache()`` with it. Here that sequence
runs the patched ``initialize_kv_cache`` (its source taken from the patched checkout at run time) on a STUB
runner (the attributes the method reads), with the XPU ops as named DOUBLES (``set_data_ipc``,
``share_external_data``, ``paddle.device.xpu.empty_cache``) and paddle's CPU place for the profile cache,
against a daemon started with ``--geometry engine``: no geometry given to kvcached.

Without ``FASTDEPLOY_SRC`` the same sequence calls ``kvcached.fastdeploy.runner.xpu_kv_cache``, what the
patched method calls, directly.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import runner_client as rc
from kvcached.fastdeploy import runner as kvcached_runner
from kvcached.status import read_status
from tests.conftest import DaemonFactory, free_port
from tests.helpers.fastdeploy_src import source

paddle = pytest.importorskip("paddle", reason="the paddle extra is not installed (pip install '.[paddle]')")
pytestmark = pytest.mark.paddle

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 16
PROFILE_BLOCKS, FASTDEPLOYS_BLOCKS = 96, 72  # the configured count, and the one profiling leaves


class XpuOpsDouble:
    """DOUBLES of FastDeploy's XPU ops, recording each call (the runner must make none of them)."""

    def __init__(self) -> None:
        self.exported: list[str] = []
        self.attached: list[str] = []

    def set_data_ipc(self, tensor: Any, name: str) -> None:
        self.exported.append(name)

    def share_external_data(self, tensor: Any, name: str, shape: Any, use_ipc: bool) -> Any:
        self.attached.append(name)
        return tensor


class AttentionBackendStub:
    """STUB of the XPU attention backend: FastDeploy's layout ``[blocks, kv_heads, block_size, head_dim]``."""

    def get_kv_cache_shape(self, max_num_blocks: int) -> tuple[list[int], list[int]]:
        shape = [max_num_blocks, KV_HEADS, BLOCK, HEAD_DIM]
        return shape, list(shape)


def runner_stub(suffix: int) -> SimpleNamespace:
    """STUB of ``XPUModelRunner``: the attributes ``initialize_kv_cache`` reads, CPU swap on (kvcached owns)."""
    model = SimpleNamespace(dtype="bfloat16", num_hidden_layers=LAYERS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    cache = SimpleNamespace(
        block_size=BLOCK, total_block_num=PROFILE_BLOCKS, num_cpu_blocks=8, kvcache_storage_backend=None
    )
    parallel = SimpleNamespace(tensor_parallel_size=1, local_engine_worker_queue_port=suffix)
    scheduler = SimpleNamespace(splitwise_role="mixed")
    fd_config = SimpleNamespace(
        model_config=model,
        cache_config=cache,
        parallel_config=parallel,
        scheduler_config=scheduler,
        quant_config=None,
        speculative_config=None,
    )
    return SimpleNamespace(
        num_gpu_blocks=PROFILE_BLOCKS,
        model_config=model,
        quant_config=None,
        attn_backends=[AttentionBackendStub()],
        local_rank=0,
        parallel_config=parallel,
        scheduler_config=scheduler,
        device_id=0,
        fd_config=fd_config,
        share_inputs={},
    )


def patched_method(ops: XpuOpsDouble, tmp: Path) -> Any:
    """The patched ``XPUModelRunner.initialize_kv_cache``, from FastDeploy's own file, on the doubles."""
    from tests.helpers.fastdeploy_engine_code import fastdeploy_checkout, patched
    from tests.helpers.fastdeploy_shell import install, source_of

    root = fastdeploy_checkout()
    install(root)
    from fastdeploy.inter_communicator import IPCSignal

    device = SimpleNamespace(xpu=SimpleNamespace(empty_cache=lambda: None))  # DOUBLE of paddle.device.xpu
    paddle_double = SimpleNamespace(full=paddle.full, empty=paddle.empty, device=device)
    namespace = {
        "os": os,
        "np": np,
        "time": time,
        "paddle": paddle_double,
        "IPCSignal": IPCSignal,
        "logger": logging.getLogger("fastdeploy.xpu_model_runner"),
        "set_data_ipc": ops.set_data_ipc,
        "share_external_data": ops.share_external_data,
    }
    source_of(
        patched(root, tmp), "fastdeploy/worker/xpu_model_runner.py", ("XPUModelRunner.initialize_kv_cache",), namespace
    )
    return namespace["initialize_kv_cache"]


def engine_signal(suffix: int) -> Any:
    """``cache_ready_signal``, created as FastDeploy's engine creates it (``common_engine.py`` ~392)."""
    from fastdeploy.inter_communicator import IPCSignal

    return IPCSignal(
        name="cache_ready_signal", array=np.zeros([1], dtype=np.int32), dtype=np.int32, suffix=suffix, create=True
    )


def direct_call(ops: XpuOpsDouble, tmp: Path) -> Any:
    """Without FastDeploy's file: what the patched method does when KVCACHED_INSTANCE is set."""

    def initialize_kv_cache(runner: SimpleNamespace, profile: bool = False) -> None:
        shapes = runner.attn_backends[0].get_kv_cache_shape(max_num_blocks=runner.num_gpu_blocks)
        caches = kvcached_runner.xpu_kv_cache(
            runner.fd_config, 0, runner.num_gpu_blocks, runner.model_config.dtype, shapes, profile=profile
        )
        assert caches is not None
        runner.share_inputs["caches"] = caches

    return initialize_kv_cache


@pytest.mark.parametrize("code", ["fastdeploy", "kvcached"])
def test_profile_then_attach_makes_one_cache_of_fastdeploys_block_count(
    daemons: DaemonFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str
) -> None:
    """The profile run's cache is the runner's own, exported under no name; after profiling the runner
    declares FastDeploy's block count and attaches kvcached's cache of exactly that count: one cache, no
    name published by the runner, its tensors kvcached's memory."""
    if code == "fastdeploy" and source() is None:
        pytest.skip("runs the patched xpu_model_runner.py: set FASTDEPLOY_SRC to a FastDeploy checkout of e53f5184")
    daemon = daemons.start(ranks=1, small=False, args=["--geometry", "engine"])
    daemon.wait_state("EMPTY")  # waiting for the engine's geometry
    monkeypatch.setenv("KVCACHED_INSTANCE", daemon.instance)
    monkeypatch.setenv("KVCACHED_WAIT_S", "30")
    suffix = 20000 + free_port() % 40000
    ops = XpuOpsDouble()
    initialize = (patched_method if code == "fastdeploy" else direct_call)(ops, tmp_path)
    runner = runner_stub(suffix)
    signal = engine_signal(suffix) if code == "fastdeploy" else None
    try:
        initialize(runner, profile=True)  # profile_run, xpu_model_runner.py ~1738-1742
        profile_cache = runner.share_inputs["caches"]
        assert [list(t.shape) for t in profile_cache] == [[PROFILE_BLOCKS, KV_HEADS, BLOCK, HEAD_DIM]] * 2 * LAYERS
        assert read_status(daemon.instance)["ranks"][0]["state"] == "EMPTY", "nothing allocated while profiling"
        runner.num_gpu_blocks = FASTDEPLOYS_BLOCKS  # update_share_input_block_num, ~1756-1764
        initialize(runner)
        caches = runner.share_inputs["caches"]
        assert read_status(daemon.instance)["spec"]["num_blocks"] == FASTDEPLOYS_BLOCKS
        assert [list(t.shape) for t in caches] == [[FASTDEPLOYS_BLOCKS, KV_HEADS, BLOCK, HEAD_DIM]] * 2 * LAYERS
        assert ops.exported == [] and ops.attached == [], "the runner exported or attached by FastDeploy's names"
        spec = rc.CacheSpec(
            num_layers=LAYERS,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            block_size=BLOCK,
            num_blocks=FASTDEPLOYS_BLOCKS,
            num_cpu_blocks=8,
        )
        with rc.initialize_kv_cache(spec, 0, instance=daemon.instance) as view:
            caches[2][5, 1, 3, 7] = 2.0  # layer 1's key: through the runner's tensor ...
            assert view.key_caches[1][5, 1, 3, 7] == 0x4000  # ... into kvcached's memory (bfloat16 2.0)
    finally:
        kvcached_runner.ATTACHED.clear()
        if signal is not None:
            signal.shm.close()
            signal.shm.unlink()


@pytest.mark.parametrize("code", ["fastdeploy", "kvcached"])
def test_a_data_parallel_groups_runner_attaches_the_rank_its_drop_in_serves(
    daemons: DaemonFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str
) -> None:
    """Two data-parallel groups of one tensor-parallel rank on one host: the runner of group 1 (its local
    rank 1, tensor-parallel rank 0: what the patched method passes) attaches kvcached rank 1, the rank
    group 1's drop-in serves (``--local_data_parallel_id 1 --mp_num 1 --rank 0``), never group 0's."""
    if code == "fastdeploy" and source() is None:
        pytest.skip("runs the patched xpu_model_runner.py: set FASTDEPLOY_SRC to a FastDeploy checkout of e53f5184")
    from kvcached.fastdeploy.arguments import group_ranks, parse_args

    daemon = daemons.start(ranks=2, small=False, args=["--geometry", "engine"])
    daemon.wait_state("EMPTY")
    monkeypatch.setenv("KVCACHED_INSTANCE", daemon.instance)
    monkeypatch.setenv("KVCACHED_WAIT_S", "30")
    initialize = (patched_method if code == "fastdeploy" else direct_call)(XpuOpsDouble(), tmp_path)
    runners, signals = [], []
    try:
        for group in (0, 1):
            suffix = 20000 + free_port() % 40000  # each data-parallel group has its engine's own ports
            signals.append(engine_signal(suffix) if code == "fastdeploy" else None)
            runner = runner_stub(suffix)
            runner.local_rank, runner.device_id = group, group  # worker_process: the worker's index on the host
            runner.parallel_config.local_data_parallel_id = group
            runner.parallel_config.data_parallel_size = 2
            runner.num_gpu_blocks = FASTDEPLOYS_BLOCKS
            initialize(runner)
            runners.append(runner)
        assert group_ranks(parse_args(["--mp_num", "1", "--local_data_parallel_id", "1", "--rank", "0"])) == [1]
        spec = rc.CacheSpec(
            num_layers=LAYERS,
            kv_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            block_size=BLOCK,
            num_blocks=FASTDEPLOYS_BLOCKS,
            num_cpu_blocks=8,
        )
        with (
            rc.initialize_kv_cache(spec, 0, instance=daemon.instance) as rank0,
            rc.initialize_kv_cache(spec, 1, instance=daemon.instance) as rank1,
        ):
            runners[1].share_inputs["caches"][0][5, 0, 0, 0] = 3.0  # group 1 computes into its block 5
            runners[0].share_inputs["caches"][0][6, 0, 0, 0] = 5.0  # group 0 into its block 6
            assert int(rank1.key_caches[0][5, 0, 0, 0]) == 0x4040 and int(rank0.key_caches[0][5, 0, 0, 0]) == 0
            assert int(rank0.key_caches[0][6, 0, 0, 0]) == 0x40A0 and int(rank1.key_caches[0][6, 0, 0, 0]) == 0
    finally:
        kvcached_runner.ATTACHED.clear()
        for signal in signals:
            if signal is not None:
                signal.shm.close()
                signal.shm.unlink()


def test_mtp_in_a_second_data_parallel_group_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """FastDeploy's MTP proposer attaches its layers by FastDeploy's names (tensor-parallel rank), kvcached
    exports them by its own rank: in data-parallel group 1 they differ, so the runner refuses, naming why."""
    monkeypatch.setenv("KVCACHED_INSTANCE", "kvt-none")
    monkeypatch.setenv("KVCACHED_WAIT_S", "5")  # were it not refused, it would wait for a daemon that is not there
    runner = runner_stub(1)
    runner.parallel_config.local_data_parallel_id = 1
    runner.fd_config.speculative_config = SimpleNamespace(num_extra_cache_layer=1, num_gpu_block_expand_ratio=1.0)
    shapes = runner.attn_backends[0].get_kv_cache_shape(max_num_blocks=FASTDEPLOYS_BLOCKS)
    with pytest.raises(rc.InvalidSpec, match="data-parallel group 1 with MTP") as refused:
        kvcached_runner.xpu_kv_cache(runner.fd_config, 0, FASTDEPLOYS_BLOCKS, "bfloat16", shapes, profile=False)
    assert refused.value.field == "data_parallel_size"
    assert "key_caches_<layer>_rank0.device<d>" in str(refused.value) and "_rank1.device<d>" in str(refused.value)


def test_a_wait_that_is_no_number_of_seconds_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``KVCACHED_WAIT_S=10m`` in the runner: an ``InvalidSpec`` naming the variable, as the drop-in says it; so
    is ``inf`` (or a number no timed wait can take), which would make the wait one without deadline."""
    monkeypatch.setenv("KVCACHED_INSTANCE", "kvt-none")
    runner = runner_stub(1)
    shapes = runner.attn_backends[0].get_kv_cache_shape(max_num_blocks=FASTDEPLOYS_BLOCKS)
    refusals = [("10m", "must be a number of seconds, got '10m'"), ("0", "must be > 0 seconds"), ("nan", "> 0")]
    refusals += [(big, f"must be at most 604800 seconds \\(a week\\), got {big}") for big in ("inf", "1e400", "1e300")]
    for value, said in refusals:
        monkeypatch.setenv("KVCACHED_WAIT_S", value)
        with pytest.raises(rc.InvalidSpec, match=said) as refused:
            kvcached_runner.xpu_kv_cache(runner.fd_config, 0, FASTDEPLOYS_BLOCKS, "bfloat16", shapes, profile=False)
        assert refused.value.field == "KVCACHED_WAIT_S"


def test_the_default_instance_is_worked_out_in_one_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner patch, the drop-in and runner_client read KVCACHED_INSTANCE alike: unset or empty is
    ``default`` (as the CLI reads it), a name is checked, a bad one refused naming the variable."""
    from kvcached.protocol.errors import InvalidSpec
    from kvcached.protocol.names import instance_or_default

    for value in (None, ""):
        if value is None:
            monkeypatch.delenv("KVCACHED_INSTANCE", raising=False)
        else:
            monkeypatch.setenv("KVCACHED_INSTANCE", value)
        assert kvcached_runner._instance() == instance_or_default() == "default"
    monkeypatch.setenv("KVCACHED_INSTANCE", "fd-1")
    assert kvcached_runner._instance() == "fd-1"
    monkeypatch.setenv("KVCACHED_INSTANCE", "no/such")
    with pytest.raises(InvalidSpec, match="KVCACHED_INSTANCE"):
        kvcached_runner._instance()
