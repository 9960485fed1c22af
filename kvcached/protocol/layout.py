"""Where each tensor of a rank lives inside its arenas. Both sides compute it from the spec alone.

Device arena (one shm object per rank), layer-major, every tensor on a page boundary::

    0                                                                                   size
    | L0.key | L0.value | L0.key_scale | L0.value_scale | L1.key | ... | L{n-1}.value_scale |
      key/value   [num_blocks, kv_heads, block_size, head_dim]   (value absent for MLA)
      scales      [num_blocks, kv_heads, block_size]             (only with block_wise_fp8)
    then the MTP layers L{n} .. L{n+m-1}, the same tensors with mtp_blocks blocks each

CPU swap pool (one shm object per rank), in one of two layouts, chosen by the device backend (the
runner never sees the pool). ``records`` (host): block-major, one block of every layer contiguous, so a
block is one record for the attention store; each record starts on a page boundary::

    | block 0: L0.key L0.value L0.key_scale L0.value_scale L1.key ... | pad | block 1: ... | pad | ...
      <------------------------- spec.block_bytes ------------------------>
      <---------------------------------- block_stride ------------------------>

``planes`` (xpu): one plane per tensor, in record order, each ``[num_cpu_blocks, tensor bytes per block]``, so that each
layer's CPU blocks lie at the device block's stride from one pointer, as FastDeploy's ``swap_cache_all_layers`` expects;
a block's record for the store is gathered from every plane. Both fit in ``cpu_pool_bytes``::

    | L0.key of block 0, 1, ... n-1 | L0.value of block 0 ... n-1 | L1.key ... | (pad)

The daemon publishes ``LAYOUT_VERSION`` and the geometry; a runner recomputes the offsets from its own
spec after checking that the geometry matches, so no offset table crosses process boundaries.
"""

from __future__ import annotations

import dataclasses
import math
import mmap
from typing import Any

import numpy as np

from kvcached.protocol.spec import CacheSpec

LAYOUT_VERSION = 1
PAGE = mmap.PAGESIZE

#: numpy dtype that views each cache dtype; bfloat16 has none, so its raw bits are viewed as uint16.
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "bfloat16": np.dtype(np.uint16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
}

KINDS = ("key", "value", "key_scale", "value_scale")


def round_up(n: int, to: int = PAGE) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


@dataclasses.dataclass(frozen=True, slots=True)
class Slot:
    """One tensor of one layer: its kind, layer, byte offset in the arena, shape and cache dtype."""

    kind: str
    layer: int
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * NUMPY_DTYPES[self.dtype].itemsize


def layer_kinds(spec: CacheSpec) -> tuple[str, ...]:
    """Kinds of tensor each layer has, in arena order."""
    kinds = ["key"] if spec.mla else ["key", "value"]
    if spec.block_wise_fp8:
        kinds += [f"{k}_scale" for k in list(kinds)]
    return tuple(kinds)


def device_slots(spec: CacheSpec) -> list[Slot]:
    """Every tensor of the device arena, in arena order, page-aligned."""
    slots = []
    offset = 0
    for layer in range(spec.all_layers):
        blocks = spec.num_blocks if layer < spec.num_layers else spec.mtp_blocks
        for kind in layer_kinds(spec):
            scale = kind.endswith("_scale")
            shape = (blocks, *(spec.scale_shape if scale else spec.cache_shape)[1:])
            slot = Slot(kind, layer, offset, shape, spec.scale_dtype if scale else spec.dtype)
            slots.append(slot)
            offset = round_up(offset + slot.nbytes)
    return slots


def device_arena_bytes(spec: CacheSpec) -> int:
    """Size of a rank's device arena, page padding included."""
    last = device_slots(spec)[-1]
    return round_up(last.offset + last.nbytes)


def cpu_block_stride(spec: CacheSpec) -> int:
    """Distance between two blocks in the CPU swap pool: ``block_bytes`` rounded up to a page."""
    return round_up(spec.block_bytes)


def cpu_pool_bytes(spec: CacheSpec) -> int:
    """Size of a rank's CPU swap pool (0 when there is none)."""
    return cpu_block_stride(spec) * spec.num_cpu_blocks


#: How a CPU pool is laid out (module docstring): ``RECORDS``, block-major (``cpu_block_stride`` apart), or ``PLANES``,
#: tensor-major (``cpu_planes``), where a device backend's own swap op wants it so.
RECORDS, PLANES = "records", "planes"
POOL_LAYOUTS = (RECORDS, PLANES)


def cpu_planes(spec: CacheSpec) -> list[tuple[int, int]]:
    """``(offset, width)`` of each tensor's plane in a ``planes`` CPU pool, in record order."""
    planes = []
    offset = 0
    for slot in device_slots(spec):
        width = slot.nbytes // slot.shape[0]
        planes.append((offset, width))
        offset += width * spec.num_cpu_blocks
    return planes


def device_views(spec: CacheSpec, buffer: Any) -> dict[str, list[np.ndarray[Any, Any]]]:
    """Zero-copy numpy views of every tensor in a device arena ``buffer``, by kind, indexed by layer. Kinds
    the spec does not have map to empty lists, so ``views["value"]`` is ``[]`` for MLA."""
    views: dict[str, list[np.ndarray[Any, Any]]] = {kind: [] for kind in KINDS}
    for slot in device_slots(spec):
        dtype = NUMPY_DTYPES[slot.dtype]
        count = slot.nbytes // dtype.itemsize
        array = np.frombuffer(buffer, dtype=dtype, count=count, offset=slot.offset).reshape(slot.shape)
        views[slot.kind].append(array)
    return views


def size_text(n: float) -> str:
    """Bytes for people, with one decimal: GiB from 1 GiB up, MiB from 1 MiB up, else KiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n / 1024:.1f} KiB"
