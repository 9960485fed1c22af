"""Every copy path moves exactly the right bytes and nothing else: the native copy and numpy, CPU pools
laid out as records and as planes, runs and shuffled ids, scales, MLA, MTP layers, odd widths, staging
rows, long tasks in steps; and the XPU whole-task swap's call shape, checked against the runtime double.

The expected bytes come from a reference written from the layout's definition (``device_slots``,
``cpu_block_stride``, ``cpu_planes``), one block and one tensor at a time.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import runner_client as rc
from kvcached import copy_engine, native
from kvcached.copy_engine import SwapEngine
from kvcached.memory.host import host_pieces
from kvcached.native import Side
from kvcached.protocol.layout import (
    PLANES,
    POOL_LAYOUTS,
    RECORDS,
    cpu_block_stride,
    cpu_planes,
    cpu_pool_bytes,
    device_arena_bytes,
    device_slots,
)
from kvcached.store import landing
from kvcached.store.landing import Targets
from tests.conftest import unique_devices

Array = np.ndarray[Any, Any]

SPECS = {
    "bf16": rc.CacheSpec(num_layers=3, kv_heads=2, head_dim=64, block_size=4, num_blocks=24, num_cpu_blocks=20),
    "scales": rc.CacheSpec(
        num_layers=2, kv_heads=2, head_dim=64, block_size=4, num_blocks=16, num_cpu_blocks=12, dtype="int8",
        block_wise_fp8=True,
    ),
    "mla": rc.CacheSpec(
        num_layers=2, kv_heads=1, head_dim=576, block_size=4, num_blocks=16, num_cpu_blocks=12, mla=True
    ),
    "mtp": rc.CacheSpec(
        num_layers=2, kv_heads=1, head_dim=64, block_size=8, num_blocks=16, num_cpu_blocks=12, mtp_layers=1,
        mtp_num_blocks=20,
    ),
    "odd": rc.CacheSpec(num_layers=2, kv_heads=1, head_dim=3, block_size=5, num_blocks=16, num_cpu_blocks=12),
}  # fmt: skip


@pytest.fixture(params=["native", "numpy"])
def engine_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "native":
        if not native.available():
            pytest.skip("the native copy was not built here (no C compiler at install time)")
    else:
        monkeypatch.setattr(native, "_LIBRARY", None)
    yield request.param


class Rank:
    """A device arena and a CPU pool in host memory, filled with random bytes, and an engine over them."""

    def __init__(self, spec: rc.CacheSpec, layout: str, seed: int = 0) -> None:
        self.spec, self.layout = spec, layout
        self.device = np.frombuffer(mmap.mmap(-1, device_arena_bytes(spec)), dtype=np.uint8)
        self.pool = np.frombuffer(mmap.mmap(-1, cpu_pool_bytes(spec)), dtype=np.uint8)
        rng = np.random.default_rng(seed)
        self.device[:] = rng.integers(0, 256, self.device.size, dtype=np.uint8)
        self.pool[:] = rng.integers(0, 256, self.pool.size, dtype=np.uint8)
        self.engine = SwapEngine(spec, list(host_pieces(spec, self.device)), self.pool, pool_layout=layout)

    def device_piece(self, block: int, index: int, buffer: Array | None = None) -> Array:
        slot = device_slots(self.spec)[index]
        width = slot.nbytes // slot.shape[0]
        start = slot.offset + block * width
        return (self.device if buffer is None else buffer)[start : start + width]

    def pool_piece(self, block: int, index: int, buffer: Array | None = None) -> Array:
        pool = self.pool if buffer is None else buffer
        if self.layout == PLANES:
            offset, width = cpu_planes(self.spec)[index]
            return pool[offset + block * width : offset + (block + 1) * width]
        widths = [slot.nbytes // slot.shape[0] for slot in device_slots(self.spec)]
        start = block * cpu_block_stride(self.spec) + sum(widths[:index])
        return pool[start : start + widths[index]]

    def pieces(self) -> range:
        return range(len(device_slots(self.spec)))


def pairs(spec: rc.CacheSpec, pattern: str, device_limit: int | None = None) -> tuple[Array, Array]:
    """Device and CPU ids of a task: runs, shuffled, one block, or reversed."""
    count = min(device_limit or spec.num_blocks, spec.num_cpu_blocks)
    rng = np.random.default_rng(7)
    if pattern == "runs":  # two runs on each side, not aligned with each other
        half = count // 2
        return np.r_[2 : 2 + half, 0:2].astype(np.int64), np.r_[0:half, half + 1 : half + 3].astype(np.int64)
    if pattern == "one":
        return np.array([count - 1]), np.array([0])
    if pattern == "reversed":
        return np.arange(count)[::-1].copy(), np.arange(count)
    return rng.permutation(count), rng.permutation(spec.num_cpu_blocks)[:count]


def device_limit(spec: rc.CacheSpec) -> int:
    """Ids every tensor has (MTP layers have fewer blocks)."""
    return min(slot.shape[0] for slot in device_slots(spec))


@pytest.mark.parametrize("pattern", ["runs", "shuffled", "one", "reversed"])
@pytest.mark.parametrize("layout", list(POOL_LAYOUTS))
@pytest.mark.parametrize("name", sorted(SPECS))
def test_swap_out_and_in_move_exactly_their_blocks(engine_kind: str, name: str, layout: str, pattern: str) -> None:
    spec = SPECS[name]
    rank = Rank(spec, layout)
    dev, cpu = pairs(spec, pattern, device_limit(spec))
    assert len(set(cpu.tolist())) == len(cpu)
    device_before, pool_before = rank.device.copy(), rank.pool.copy()
    expected = pool_before.copy()
    for d, c in zip(dev.tolist(), cpu.tolist(), strict=True):
        for p in rank.pieces():
            rank.pool_piece(c, p, expected)[:] = rank.device_piece(d, p)
    assert rank.engine.swap_out(dev, cpu) == len(dev) * spec.block_bytes
    assert np.array_equal(rank.pool, expected), "swap_out wrote other bytes, or other places"
    assert np.array_equal(rank.device, device_before), "swap_out changed the device tier"

    rank.pool[:] = np.random.default_rng(3).integers(0, 256, rank.pool.size, dtype=np.uint8)
    targets = np.roll(dev, 1)
    expected_device = rank.device.copy()
    for c, d in zip(cpu.tolist(), targets.tolist(), strict=True):
        for p in rank.pieces():
            rank.device_piece(d, p, expected_device)[:] = rank.pool_piece(c, p)
    pool_now = rank.pool.copy()
    assert rank.engine.swap_in(cpu, targets) == len(dev) * spec.block_bytes
    assert np.array_equal(rank.device, expected_device), "swap_in wrote other bytes, or other places"
    assert np.array_equal(rank.pool, pool_now), "swap_in changed the pool"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_staging_rows_are_whole_block_records(engine_kind: str, name: str) -> None:
    """The store's staging rows (stride above the block's bytes): each row is the block's pieces in record
    order, and copying a row back restores every piece; the padding is never touched."""
    spec = SPECS[name]
    rank = Rank(spec, PLANES)
    staging = np.full((5, spec.block_bytes + 100), 0xEE, dtype=np.uint8)
    dev = np.array([3, 1, 2])
    rank.engine.copy_out(dev, np.array([4, 0, 2]), staging)
    for row, d in zip((4, 0, 2), dev.tolist(), strict=True):
        record = b"".join(rank.device_piece(d, p).tobytes() for p in rank.pieces())
        assert staging[row, : spec.block_bytes].tobytes() == record
    assert (staging[:, spec.block_bytes :] == 0xEE).all() and (staging[[1, 3]] == 0xEE).all()
    rank.engine.copy_in(np.array([4]), np.array([5]), staging)
    for p in rank.pieces():
        assert np.array_equal(rank.device_piece(5, p), rank.device_piece(3, p))


def test_a_long_task_moves_in_steps_and_marks_progress(engine_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = SPECS["bf16"]
    monkeypatch.setattr(copy_engine, "STEP_BYTES", 3 * spec.block_bytes)
    steps: list[int] = []
    rank = Rank(spec, RECORDS)
    rank.engine.on_step = lambda: steps.append(1)
    dev, cpu = np.arange(10), np.arange(10)
    rank.engine.swap_out(dev, cpu)
    assert len(steps) >= 4, "a task of 10 blocks in steps of 3 marks progress at least 4 times"
    for d in range(10):
        for p in rank.pieces():
            assert np.array_equal(rank.pool_piece(d, p), rank.device_piece(d, p))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_native_and_numpy_agree_on_any_task(data: st.DataObject) -> None:
    """Random specs' pools, random tasks: both engines leave identical bytes."""
    if not native.available():
        pytest.skip("the native copy was not built here")
    name = data.draw(st.sampled_from(sorted(SPECS)))
    layout = data.draw(st.sampled_from(list(POOL_LAYOUTS)))
    spec = SPECS[name]
    limit = device_limit(spec)
    n = data.draw(st.integers(0, min(limit, spec.num_cpu_blocks)))
    dev = np.array(data.draw(st.lists(st.integers(0, limit - 1), min_size=n, max_size=n)), dtype=np.int64)
    cpu = np.array(data.draw(st.permutations(range(spec.num_cpu_blocks)))[:n], dtype=np.int64)
    results = []
    for use_native in (True, False):
        rank = Rank(spec, layout, seed=11)
        if not use_native:
            rank.engine.device_side = None
        rank.engine.swap_out(dev, cpu)
        results.append(rank.pool.copy())
    assert np.array_equal(*results)


def _layout(data: st.DataObject, blocks: int) -> tuple[Side, list[int]]:
    """A side of random pieces (odd widths and strides, unaligned starts) and the blocks of a load."""
    widths = data.draw(st.lists(st.integers(1, 3000), min_size=1, max_size=6))
    arena = np.zeros(sum(w + 7 for w in widths) * blocks + 64, dtype=np.uint8)
    views, offset = [], data.draw(st.integers(0, 31))
    for width in widths:
        views.append(np.lib.stride_tricks.as_strided(arena[offset:], (blocks, width), (width + 7, 1)))
        offset += (width + 7) * blocks
    ids = data.draw(st.permutations(range(blocks)))[: data.draw(st.integers(1, blocks))]
    return Side.of(views), ids


@pytest.mark.parametrize("kind", ["native", "numpy"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_landing_moves_exactly_the_record_and_returns_its_xxh3(
    kind: str, data: st.DataObject, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """land (memory into a target's pieces), read_into (a file into them, through a buffer of any size) and gather
    (pieces into one buffer) move exactly the record's bytes, touch no byte outside the target, and return
    the XXH3-64 the object header records (xxhash's), natively and without the native routines."""
    if kind == "native" and not native.available():
        pytest.skip("the native copy was not built here")
    saved = native._LIBRARY
    if kind == "numpy":
        native._LIBRARY = None
    try:
        side, ids = _layout(data, 4)
        targets = Targets(side, ids)
        total = int(side.widths.sum())
        records = [np.random.default_rng(i).integers(0, 256, total, dtype=np.uint8) for i in range(len(ids))]
        path = tmp_path_factory.mktemp("landing") / "objects"
        path.write_bytes(b"H" * 128 + b"".join(r.tobytes() for r in records))
        bounce = memoryview(bytearray(data.draw(st.sampled_from([1, 100, 4096, 1 << 20]))))
        fd = os.open(path, os.O_RDONLY)
        try:
            for i, record in enumerate(records):
                before = [view.copy() for view in side.views]
                how = data.draw(st.sampled_from(["land", "read"]))
                if how == "land":
                    (digest,) = landing.land(targets, [i], [memoryview(record)])
                else:
                    assert landing.read_into(fd, 128 + i * total, targets, i, bounce) == (total, digest := xxh3(record))
                assert digest == xxh3(record)
                assert b"".join(bytes(v) for v in targets.views(i)) == record.tobytes()
                for view, old in zip(side.views, before, strict=True):
                    old[ids[i]] = view[ids[i]]
                    assert np.array_equal(view, old), "a byte outside the target changed"
                flat = np.zeros(total, dtype=np.uint8)
                assert landing.gather(targets.views(i), memoryview(flat)) == digest
                assert flat.tobytes() == record.tobytes()
            short = landing.read_into(fd, 128 + (len(records) - 1) * total + 1, targets, 0, bounce)
            assert short == (total - 1, None), "a payload cut short has no checksum"
        finally:
            os.close(fd)
    finally:
        native._LIBRARY = saved


def xxh3(record: Array) -> int:
    value: int = xxhash.xxh3_64_intdigest(record.tobytes())
    return value


def test_xpu_swap_is_fastdeploys_op_once_per_kind_over_the_pool_planes() -> None:
    """The xpu backend (its own code over the TEST DOUBLE of its runtime) swaps a task with one call of
    FastDeploy's swap_cache_all_layers per tensor kind: every layer's tensor of that kind, the pointer of
    each one's pool plane, the pool's block count, the ids as lists, the device, mode 0 out / 1 in."""
    pytest.importorskip("paddle", reason="the xpu backend's code needs paddle (pip install '.[paddle]')")
    import paddle

    import tests.plugins.xpu_double as double
    from kvcached import memory
    from kvcached.memory.base import TierRequest

    spec = rc.CacheSpec(
        num_layers=3, kv_heads=1, head_dim=64, block_size=4, num_blocks=8, num_cpu_blocks=6, dtype="int8",
        block_wise_fp8=True,
    )  # fmt: skip
    double.XpuRuntimeDouble.exported.clear()
    double.XpuRuntimeDouble.calls.clear()
    backend = memory.get("xpu-double")
    assert backend.pool_layout == PLANES
    request = TierRequest("kvt-copy", 1, 0, spec, device_id=unique_devices(1)[0])
    tier = backend.create(request, lambda done: None)
    try:
        rng = np.random.default_rng(5)
        for piece in tier.pieces:
            piece.write(0, rng.integers(0, 256, (spec.num_blocks, piece.nbytes), dtype=np.uint8))
        pool = mmap.mmap(-1, cpu_pool_bytes(spec))
        swap = tier.pool_swap(pool)
        assert swap is not None
        engine = SwapEngine(spec, tier.pieces, pool, pool_layout=PLANES, tier_swap=swap)
        engine.swap_out(np.array([6, 2, 3]), np.array([0, 4, 5]))
        anchor = ctypes.c_char.from_buffer(pool)
        base = ctypes.addressof(anchor)
        del anchor
        planes = cpu_planes(spec)
        kinds = ("key", "value", "key_scale", "value_scale")
        calls = double.XpuRuntimeDouble.calls
        assert len(calls) == 4, "one call per tensor kind"
        for k, (shapes, pointers, count, dev_ids, cpu_ids, device, mode) in enumerate(calls):
            slots = [i for i, s in enumerate(device_slots(spec)) if s.kind == kinds[k]]
            assert shapes == [device_slots(spec)[i].shape for i in slots]
            assert pointers == [base + planes[i][0] for i in slots]
            assert (count, dev_ids, cpu_ids, device, mode) == (6, [6, 2, 3], [0, 4, 5], request.device_id, 0)
        pool_u8 = np.frombuffer(pool, dtype=np.uint8)
        for i, piece in enumerate(tier.pieces):
            offset, width = planes[i]
            for d, c in ((6, 0), (2, 4), (3, 5)):
                assert np.array_equal(pool_u8[offset + c * width : offset + (c + 1) * width], piece.read(d, 1)[0])
        calls.clear()
        engine.swap_in(np.array([4, 0]), np.array([1, 7]))
        assert [call[3:] for call in calls] == [([1, 7], [4, 0], request.device_id, 1)] * 4
        for piece in tier.pieces:
            assert np.array_equal(piece.read(1, 1), piece.read(2, 1)) and np.array_equal(
                piece.read(7, 1), piece.read(6, 1)
            )
        staging = np.zeros((1, spec.block_bytes), np.uint8)  # the store path: a whole record, from the tensors
        engine.copy_out(np.array([7]), np.array([0]), staging)
        assert staging[0].tobytes() == b"".join(piece.read(7, 1).tobytes() for piece in tier.pieces)
        assert paddle.view(double.XpuRuntimeDouble.exported[tier.exports[0].name], "uint8").shape[0] == spec.num_blocks
    finally:
        tier.close()
        backend.release(request)
