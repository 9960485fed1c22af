"""Drop-in FastDeploy compatibility: IPCSignal ready flags, export names and shapes, spec from its config."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import runner_client as rc
from kvcached.fastdeploy.names import TENSOR_NAMES, spec_from_fastdeploy
from kvcached.memory.xpu import exports
from kvcached.protocol.names import SHM_DIR
from kvcached.status import read_status
from tests.conftest import DaemonFactory, run_runner, runner_result
from tests.helpers.fastdeploy_src import pieces

SMALL = rc.CacheSpec(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4)

# -- FastDeploy's flags: the daemon writes none ------------------------------------------------------------


def busy(seconds: float) -> None:
    """Spin for ``seconds``: load a core as another tenant of the host would."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


def test_the_engine_recreates_its_flags_3000_times_beside_the_daemon_and_never_finds_a_name_taken(
    daemons: DaemonFactory,
) -> None:
    """FastDeploy's own ``IPCSignal(create=True)`` (unlink, then an exclusive create) on both flag names, 3,000
    times each, while a daemon started with the deprecated ``--ipc-suffix``/``--engine-user`` runs and two busy
    processes per core load the host: not one create fails, and the daemon never holds either name (nothing of
    it is mapped in the daemon's processes). The start says the options are ignored, naming them."""
    fd = pieces()
    suffix = 40000 + (os.getpid() * 7 + time.monotonic_ns()) % 20000
    names = [f"{name}.{suffix}" for name in ("cache_ready_signal", "swap_space_ready_signal")]
    load = [multiprocessing.get_context("fork").Process(target=busy, args=(120,)) for _ in range(2 * os.cpu_count())]
    daemon = daemons.start(ranks=2, args=["--ipc-suffix", str(suffix), "--engine-user", "root"])
    try:
        daemon.wait_ready()
        assert "--ipc-suffix: deprecated, does nothing" in daemon.log()
        assert "--engine-user: deprecated, does nothing" in daemon.log()
        for process in load:
            process.start()
        failures = []
        for i in range(3000):
            for name in ("cache_ready_signal", "swap_space_ready_signal"):
                try:
                    signal = fd.IPCSignal(
                        name=name, array=np.full([2], i % 2, dtype=np.int32), dtype=np.int32, suffix=suffix, create=True
                    )
                except FileExistsError as exc:
                    failures.append((i, name, str(exc)))
                    continue
                assert list(signal.value) == [i % 2] * 2, "the engine's own values, written by nobody else"
                signal.clear()
        assert failures == []
        pids = [daemon.proc.pid, *(int(p) for p in daemon_children(daemon.proc.pid))]
        mapped = [line for pid in pids for line in Path(f"/proc/{pid}/maps").read_text().splitlines()]
        assert not [line for line in mapped if any(name in line for name in names)]
        assert daemon.stop() == 0
    finally:
        for process in load:
            if process.is_alive():
                process.kill()
            process.join(10)
        for name in names:
            (SHM_DIR / name).unlink(missing_ok=True)


def daemon_children(pid: int) -> list[str]:
    """The pids of ``pid``'s child processes (its rank workers)."""
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


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
    spec = spec_from_fastdeploy(fd_config(cpu=16, **changes), 1, mla=mla, platform=platform)
    got = [(e.name, e.shape, e.dtype) for e in exports(spec, TENSOR_NAMES, local_rank=1, device_id=1)]
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
        spec = spec_from_fastdeploy(config, 0)
        fd_creates = rc.should_create_cache(
            False,
            config.cache_config.num_cpu_blocks,
            config.cache_config.kvcache_storage_backend,
            config.scheduler_config.splitwise_role,
        )
        assert (rc.cache_owner(spec) == "runner") == fd_creates, changes
    assert spec_from_fastdeploy(fd_config(kv_heads=2, tp=8), 7).kv_heads == 1, "never below 1 (FastDeploy #3717)"
    with pytest.raises(rc.InvalidSpec) as info:
        spec_from_fastdeploy(fd_config(backend="attention_store"), 0)
    assert info.value.field == "kvcache_storage_backend"
    with pytest.raises(rc.InvalidArgument) as info:
        spec_from_fastdeploy(fd_config(), 4)
    assert info.value.field == "local_rank"


def test_runner_attaches_with_a_spec_from_fastdeploy(daemons: DaemonFactory) -> None:
    """The spec read from a FastDeploy config attaches to a daemon started with the same geometry."""
    config = fd_config(layers=2, kv_heads=4, tp=2, head_dim=16, block_size=4, blocks=8, cpu=4)
    spec = spec_from_fastdeploy(config, 1)
    geometry = ["--num-layers", "2", "--kv-heads", "2", "--head-dim", "16", "--block-size", "4"]
    daemon = daemons.start(ranks=2, small=False, args=[*geometry, "--num-blocks", "8", "--num-cpu-blocks", "4"])
    daemon.wait_ready()
    result = runner_result(run_runner(daemons.env(), spec=spec.to_dict(), rank=1, instance=daemon.instance))
    assert result["ok"] and result["owner"] == "daemon", result
