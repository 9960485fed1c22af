"""framework="paddle": paddle CPU tensors that alias the daemon's memory (DLPack, zero-copy)."""

from __future__ import annotations

import pytest

import runner_client as rc
from tests.conftest import DaemonFactory

paddle = pytest.importorskip("paddle", reason="the paddle extra is not installed (pip install '.[paddle]')")

pytestmark = pytest.mark.paddle


@pytest.mark.parametrize(
    ("dtype", "paddle_dtype"), [("bfloat16", "bfloat16"), ("float32", "float32"), ("int8", "int8")]
)
def test_paddle_tensors_alias_daemon_memory(daemons: DaemonFactory, dtype: str, paddle_dtype: str) -> None:
    """A write through a paddle tensor is read through a numpy attach of the same rank, and back."""
    daemon = daemons.start(ranks=1, args=["--dtype", dtype, "--block-wise-fp8"])
    daemon.wait_ready()
    spec = rc.CacheSpec(
        num_layers=2,
        kv_heads=2,
        head_dim=16,
        block_size=4,
        num_blocks=8,
        num_cpu_blocks=4,
        dtype=dtype,
        block_wise_fp8=True,
    )
    with (
        rc.initialize_kv_cache(spec, 0, instance=daemon.instance, framework="paddle") as pcache,
        rc.initialize_kv_cache(spec, 0, instance=daemon.instance) as ncache,
    ):
        key = pcache.value_caches[1]
        assert isinstance(key, paddle.Tensor)
        assert str(key.dtype).endswith(paddle_dtype) and list(key.shape) == list(spec.cache_shape)
        assert key.place.is_cpu_place()
        key[3, 1, 2, 5] = 2
        raw = ncache.value_caches[1][3, 1, 2, 5]
        assert (raw == 0x4000) if dtype == "bfloat16" else (raw == 2)  # bf16 2.0 is 0x4000
        ncache.key_cache_scales[0][7, 1, 3] = 0.5
        assert float(pcache.key_cache_scales[0][7, 1, 3]) == 0.5


def test_paddle_runner_owned_cache(run_dir: object) -> None:
    """When the runner owns the cache, framework="paddle" returns paddle tensors of the right shape."""
    spec = rc.CacheSpec(num_layers=3, kv_heads=1, head_dim=8, block_size=4, num_blocks=5, mla=True)
    with rc.initialize_kv_cache(spec, 0, instance="kvt-paddle-local", framework="paddle") as cache:
        assert cache.owner == "runner" and cache.value_caches == []
        assert [list(t.shape) for t in cache.key_caches] == [[5, 1, 4, 8]] * 3
        cache.key_caches[2][4, 0, 3, 7] = 1.5
        assert float(cache.key_caches[2][4, 0, 3, 7]) == 1.5
