"""CacheSpec: validation names the field and what is allowed; sizes are computed in one place."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kvcached.protocol.layout import PAGE, cpu_block_stride, cpu_pool_bytes, device_arena_bytes, device_slots
from runner_client import CacheSpec, InvalidSpec

BASE: dict[str, Any] = dict(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8)


def spec(**changes: Any) -> CacheSpec:
    return CacheSpec(**{**BASE, **changes})


@pytest.mark.parametrize("field", ["num_layers", "kv_heads", "head_dim", "block_size", "num_blocks"])
@pytest.mark.parametrize("value", [0, -1])
def test_sizes_must_be_positive(field: str, value: int) -> None:
    """A zero or negative size is refused, naming the field."""
    with pytest.raises(InvalidSpec) as info:
        spec(**{field: value})
    assert info.value.field == field
    assert ">= 1" in str(info.value)


def test_kv_heads_zero_explains_tensor_parallel_division() -> None:
    """kv_heads == 0 (heads // tp rounded to zero) says that kv_heads is per rank."""
    with pytest.raises(InvalidSpec, match="tensor_parallel_size"):
        spec(kv_heads=0)


@pytest.mark.parametrize("value", [True, 2.0, "8", None])
def test_sizes_must_be_integers(value: object) -> None:
    """Booleans, floats and strings are not sizes."""
    with pytest.raises(InvalidSpec) as info:
        spec(num_blocks=value)
    assert info.value.field == "num_blocks"


def test_negative_cpu_blocks_refused() -> None:
    """num_cpu_blocks may be 0 but not negative."""
    assert spec(num_cpu_blocks=0).cpu_bytes == 0
    with pytest.raises(InvalidSpec) as info:
        spec(num_cpu_blocks=-1)
    assert info.value.field == "num_cpu_blocks"


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("dtype", "fp8", "bfloat16, float16, float32, int8, uint8"),
        ("splitwise_role", "both", "mixed, prefill, decode"),
        ("storage_backend", "Redis!", "must be a backend name (lower-case letters, digits, _) or none"),
        ("scale_dtype", "int8", "float32, bfloat16, float16"),
    ],
)
def test_unknown_names_list_the_allowed_ones(field: str, value: str, allowed: str) -> None:
    """An unknown dtype, role or backend names the field and every allowed value."""
    with pytest.raises(InvalidSpec) as info:
        spec(**{field: value})
    assert info.value.field == field
    assert allowed in str(info.value)


def test_size_that_overflows_the_host_is_refused() -> None:
    """A rank larger than a 64-bit address space can map is refused at construction."""
    with pytest.raises(InvalidSpec, match="more than a 64-bit host can map"):
        spec(num_blocks=2**40, kv_heads=64, head_dim=256, block_size=64)


def test_bytes_per_block_and_rank() -> None:
    """block_bytes covers all layers, key and value, and scales; MLA drops the value cache."""
    s = spec(dtype="bfloat16")
    assert s.cache_block_bytes == 2 * 4 * 16 * 2
    assert s.block_bytes == 2 * 2 * s.cache_block_bytes
    assert s.device_bytes == 8 * s.block_bytes
    fp8 = spec(dtype="int8", block_wise_fp8=True)
    assert fp8.scale_block_bytes == 2 * 4 * 4
    assert fp8.block_bytes == 2 * 2 * (2 * 4 * 16 + 2 * 4 * 4)
    assert spec(mla=True).block_bytes == s.block_bytes // 2


def test_from_dict_rejects_unknown_and_missing_fields() -> None:
    """from_dict names an unknown key (listing the known ones) and a missing required one."""
    with pytest.raises(InvalidSpec, match="known fields are") as info:
        CacheSpec.from_dict({**BASE, "heads": 4})
    assert info.value.field == "heads"
    with pytest.raises(InvalidSpec, match="required") as info:
        CacheSpec.from_dict({k: v for k, v in BASE.items() if k != "head_dim"})
    assert info.value.field == "head_dim"
    assert CacheSpec.from_dict(spec().to_dict()) == spec()


def test_geometry_digest_ignores_ownership_switches() -> None:
    """Role and storage backend decide ownership, not memory: they do not change the digest."""
    assert spec().geometry_digest == spec(splitwise_role="decode", storage_backend="file").geometry_digest
    assert spec().geometry_digest != spec(num_blocks=9).geometry_digest


@pytest.mark.parametrize("changes", [{}, {"mla": True}, {"block_wise_fp8": True, "dtype": "int8"}])
def test_device_layout_is_page_aligned_and_disjoint(changes: dict[str, Any]) -> None:
    """Every tensor starts on a page and no two overlap; the arena covers them all."""
    s = spec(**changes)
    slots = device_slots(s)
    assert len(slots) == s.num_layers * s.caches_per_layer * (2 if s.block_wise_fp8 else 1)
    for a, b in itertools.pairwise(slots):
        assert a.offset % PAGE == 0 and a.offset + a.nbytes <= b.offset
    assert slots[-1].offset + slots[-1].nbytes <= device_arena_bytes(s)
    assert device_arena_bytes(s) % PAGE == 0


def test_cpu_pool_is_block_major_with_page_stride() -> None:
    """The swap pool holds num_cpu_blocks records of block_bytes, each on a page boundary."""
    s = spec(num_cpu_blocks=3)
    assert cpu_block_stride(s) % PAGE == 0 and cpu_block_stride(s) >= s.block_bytes
    assert cpu_pool_bytes(s) == 3 * cpu_block_stride(s)
