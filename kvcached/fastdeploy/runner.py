"""kvcached inside FastDeploy's own processes: what the patch's runner and cache-messager hunks call, so that the
decisions live (and are tested) in kvcached (docs/fastdeploy.md, *The patch*):

* ``xpu_kv_cache``: the XPU runner's ``initialize_kv_cache`` (``worker/xpu_model_runner.py`` ~1222). The profile run
  (``profile_run`` ~1736-1742; FastDeploy profiles by default, ``engine/common_engine.py`` ~235) gets a cache of its
  own, exported under no name: ``set_data_ipc`` would give it the names kvcached's XPU tier exports, overwriting that
  record (``xpu_multiprocess.h`` ~50). After profiling the fixed condition decides on FastDeploy's own block count; when
  kvcached owns the cache the runner declares its spec (a daemon started with ``--geometry engine`` allocates exactly
  that), waits for the rank (bounded) and attaches it.
* ``messager_cache``: the splitwise cache messager (``cache_manager/cache_messager.py`` ``main`` ~965-1051), which
  always allocates: with kvcached it attaches kvcached's tensors instead.

The attached ``KVCache`` objects are kept in ``ATTACHED`` for as long as FastDeploy uses their tensors."""

from __future__ import annotations

import argparse
from typing import Any

import runner_client as rc
from kvcached.fastdeploy.arguments import env_seconds, group_ranks, mtp_names_differ
from kvcached.fastdeploy.names import spec_from_fastdeploy
from kvcached.protocol.errors import InvalidSpec
from kvcached.protocol.instance import read_instance
from kvcached.protocol.names import instance_or_default
from kvcached.protocol.spec import CacheSpec

#: The caches attached in this process, by kvcached rank (their tensors alias kvcached's memory).
ATTACHED: dict[int, rc.KVCache] = {}


def _instance() -> str:
    return instance_or_default()


def _wait_s() -> float:
    """``KVCACHED_WAIT_S`` (600 s), or ``InvalidSpec`` naming it."""
    return env_seconds("KVCACHED_WAIT_S", 600.0)


def kvcached_rank(fd_config: Any, local_rank: int) -> int:
    """The kvcached rank of the runner of tensor-parallel rank ``local_rank`` (``self.local_rank %
    tensor_parallel_size``, as the runner passes it): ``local_data_parallel_id * tensor_parallel_size + local_rank``,
    the rank its drop-in serves (``arguments.group_ranks``; docs/fastdeploy.md, *Data parallelism*). FastDeploy's MTP
    proposer attaches its layers by FastDeploy's names, which are kvcached's with one data-parallel group only
    (``spec_decode/mtp.py`` ~236-290), so MTP with more is refused (``InvalidSpec`` naming ``data_parallel_size``)."""
    parallel = getattr(fd_config, "parallel_config", None)
    tp = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    dp_id = int(getattr(parallel, "local_data_parallel_id", 0) or 0)
    speculative = getattr(fd_config, "speculative_config", None)
    mtp = int(getattr(speculative, "num_extra_cache_layer", 0) or 0)
    if dp_id and mtp:
        raise InvalidSpec("data_parallel_size", mtp_names_differ(dp_id, local_rank, dp_id * tp + local_rank))
    return dp_id * tp + local_rank


def xpu_kv_cache(
    fd_config: Any,
    local_rank: int,
    num_blocks: int,
    cache_type: str,
    shapes: tuple[list[int], list[int]],
    *,
    profile: bool,
) -> list[Any] | None:
    """The XPU runner's cache tensors, key and value per layer (``share_inputs["caches"]``), or None when the runner
    owns its cache by the fixed condition (then FastDeploy's own code creates it)."""
    if profile:  # the profile run's cache: the runner's alone, exported under no name
        import paddle

        full: Any = paddle.full
        layers = int(fd_config.model_config.num_hidden_layers)
        return [full(shape=shape, fill_value=0, dtype=cache_type) for _ in range(layers) for shape in shapes]
    spec = spec_from_fastdeploy(fd_config, local_rank, num_blocks=num_blocks, platform="xpu")
    if rc.cache_owner(spec) != "daemon":
        return None
    rank = kvcached_rank(fd_config, local_rank)
    cache = rc.initialize_kv_cache(spec, rank, instance=_instance(), timeout=_wait_s(), framework="paddle")
    ATTACHED[rank] = cache
    return [t for pair in zip(cache.key_caches, cache.value_caches, strict=True) for t in pair]


def messager_cache(args: argparse.Namespace) -> tuple[dict[str, Any], list[Any], list[Any]]:
    """The cache messager's ``gpu_cache_kvs`` (FastDeploy's names), key and value tensors, from kvcached's rank (the
    engine's runner or drop-in declares the geometry); ``InvalidSpec`` names a messager argument that disagrees with the
    daemon."""
    rank = group_ranks(args)[args.rank]
    rc.wait_until_ready(_instance(), rank, timeout=_wait_s())
    found = read_instance(_instance(), live=False)
    if found is None:
        raise rc.DaemonGone(f"instance {_instance()!r}: no daemon")
    spec = CacheSpec.from_dict(found.header.spec)
    key = [int(i) for i in args.key_cache_shape.split(",")]
    if key != list(spec.cache_shape) or args.num_layers != spec.num_layers:
        raise InvalidSpec(
            "key_cache_shape",
            f"the engine says {key} x {args.num_layers} layers, kvcached holds "
            f"{list(spec.cache_shape)} x {spec.num_layers}",
        )
    cache = rc.initialize_kv_cache(spec, rank, instance=_instance(), timeout=_wait_s(), framework="paddle")
    ATTACHED[rank] = cache
    kvs: dict[str, Any] = {}
    suffix = f"rank{args.rank}_device{args.device_id}"
    for kind in ("key_caches", "value_caches", "key_cache_scales", "value_cache_scales"):  # KVCache's names
        kvs.update({f"{kind}_{i}_{suffix}": tensor for i, tensor in enumerate(getattr(cache, kind))})
    return kvs, list(cache.key_caches), list(cache.value_caches)
