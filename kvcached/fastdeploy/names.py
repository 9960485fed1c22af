"""FastDeploy's names, shapes and dtypes for a rank's KV cache, and a ``CacheSpec`` read from its config.

``TENSOR_NAMES`` is what the daemon gives the xpu backend to export under (``kvcached.memory.xpu.name_tensors``, called
by ``kvcached start``), so that FastDeploy's own processes (the MTP proposer, the cache messager) find kvcached's
tensors by FastDeploy's names; ``spec_from_fastdeploy`` is what the patched runner declares. Read from FastDeploy's code
at develop ``e53f5184`` (2026-04-15): docs/fastdeploy.md (*Names, shapes, dtypes*) tabulates each tensor a runner
creates (``set_data_ipc``) or attaches (``share_external_data``) per layer, with its shape and dtype on each platform;
``tests/test_fastdeploy.py`` keeps a table of every case with the file and line each was read from, and checks those
lines when ``FASTDEPLOY_SRC`` names a checkout."""

from __future__ import annotations

import os
from typing import Any

from kvcached.protocol.errors import InvalidArgument, InvalidSpec
from kvcached.protocol.spec import CacheSpec

#: FastDeploy's IPC name of each tensor kind (``kvcached.memory.xpu.KINDS``), e.g. ``key_caches_3_rank1.device1``.
TENSOR_NAMES = {
    "key": "key_caches_{layer}_rank{rank}.device{device}",
    "value": "value_caches_{layer}_rank{rank}.device{device}",
    "key_scale": "key_cache_scales_{layer}_rank{rank}.device{device}",
    "value_scale": "value_cache_scales_{layer}_rank{rank}.device{device}",
}
PLATFORMS = ("xpu", "gpu")


def _get(obj: Any, path: str, default: Any = None) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return default
    return obj


def spec_from_fastdeploy(
    fd_config: Any, local_rank: int, *, num_blocks: int | None = None, mla: bool | None = None, platform: str = "xpu"
) -> CacheSpec:
    """The ``CacheSpec`` of one rank of a FastDeploy ``FDConfig`` as the runner of ``platform`` ("xpu" or "gpu") lays it
    out (attributes read, nothing imported). ``num_blocks`` stands for ``cache_config.total_block_num`` (after profiling
    FastDeploy fixes the count); MLA follows ``FD_ATTENTION_BACKEND == "MLA_ATTN"`` unless ``mla`` is given. Raises
    ``InvalidSpec`` naming FastDeploy's option when a value is missing or unsupported, ``InvalidArgument`` for a bad
    ``platform`` or ``local_rank``."""
    if platform not in PLATFORMS:
        raise InvalidArgument("platform", f"must be one of {', '.join(PLATFORMS)}; got {platform!r}")
    tp = int(_get(fd_config, "parallel_config.tensor_parallel_size", 1))
    if not 0 <= local_rank < max(tp, 1):
        raise InvalidArgument("local_rank", f"must be 0..{tp - 1} for tensor_parallel_size {tp}, got {local_rank}")
    layers, heads, head_dim, block_size, blocks = _required(fd_config, num_blocks)
    backend = _get(fd_config, "cache_config.kvcache_storage_backend") or None
    if backend == "attention_store":
        raise InvalidSpec(
            "kvcache_storage_backend",
            "attention_store is an external SDK kvcached does not speak; use file or mooncake",
        )
    model_dtype = str(_get(fd_config, "model_config.dtype", "bfloat16"))
    quant = _get(fd_config, "quant_config.kv_cache_quant_type")
    if mla is None:
        mla = os.environ.get("FD_ATTENTION_BACKEND") == "MLA_ATTN"
    kv_heads, width = _heads_and_width(fd_config, max(1, heads // max(tp, 1)), head_dim, mla=mla, platform=platform)
    if quant and platform == "gpu" and quant == "int4_zp":
        width //= 2
    extra = int(_get(fd_config, "speculative_config.num_extra_cache_layer", 0) or 0)
    ratio = float(_get(fd_config, "speculative_config.num_gpu_block_expand_ratio", 1.0) or 1.0)
    fp8 = quant == "block_wise_fp8" and platform == "gpu"
    return CacheSpec(
        num_layers=layers,
        kv_heads=kv_heads,
        head_dim=width,
        block_size=block_size,
        dtype=("int8" if platform == "xpu" else "uint8") if quant else model_dtype,
        num_blocks=blocks,
        num_cpu_blocks=int(_get(fd_config, "cache_config.num_cpu_blocks", 0) or 0),
        storage_backend=backend,
        splitwise_role=str(_get(fd_config, "scheduler_config.splitwise_role", "mixed")),
        block_wise_fp8=fp8,
        mla=bool(mla),
        scale_dtype=model_dtype if fp8 else "float32",
        mtp_layers=extra,
        mtp_num_blocks=int(blocks * ratio) if extra and ratio != 1.0 else 0,
    )


def _required(fd_config: Any, num_blocks: int | None) -> tuple[int, int, int, int, int]:
    """Layers, KV heads (all ranks'), head dim, block size and block count, each required."""
    heads = _get(fd_config, "model_config.num_key_value_heads")
    if heads is None:
        heads = _get(fd_config, "model_config.num_attention_heads")
    values = {
        "model_config.num_hidden_layers": _get(fd_config, "model_config.num_hidden_layers"),
        "model_config.num_key_value_heads": heads,
        "model_config.head_dim": _get(fd_config, "model_config.head_dim"),
        "cache_config.block_size": _get(fd_config, "cache_config.block_size"),
        "cache_config.total_block_num (or num_blocks=)": (
            num_blocks if num_blocks is not None else _get(fd_config, "cache_config.total_block_num")
        ),
    }
    for option, value in values.items():
        if value is None:
            raise InvalidSpec(option.split(" ")[0], f"FastDeploy config has no {option}")
    layers, kv_heads, head_dim, block_size, blocks = (int(value) for value in values.values())
    return layers, kv_heads, head_dim, block_size, blocks


def _heads_and_width(fd_config: Any, kv_heads: int, head_dim: int, *, mla: bool, platform: str) -> tuple[int, int]:
    """The KV heads per rank and the width of one head as the runner of ``platform`` lays them out: MLA on GPU keeps one
    latent head of ``kv_lora_rank + qk_rope_head_dim``."""
    if not mla:
        return kv_heads, head_dim
    if platform != "gpu":
        raise InvalidSpec("FD_ATTENTION_BACKEND", "MLA_ATTN: FastDeploy's XPU runner at e53f5184 has no MLA layout")
    lora, rope = _get(fd_config, "model_config.kv_lora_rank"), _get(fd_config, "model_config.qk_rope_head_dim")
    if lora is None or rope is None:
        raise InvalidSpec("model_config.kv_lora_rank", "an MLA model's config has kv_lora_rank and qk_rope_head_dim")
    return 1, int(lora) + int(rope)
