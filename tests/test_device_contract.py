"""The device-backend contract: what the swap engine and the runners rely on, for every memory backend.

``host`` runs here on a real shm arena. ``xpu`` runs on a Kunlun host with ``KVCACHED_TEST_XPU=1`` (real
paddle-xpu and FastDeploy ops) and is skipped elsewhere, with the reason. ``xpu-double`` runs the xpu
backend's own code here with ``XpuRuntimeDouble``, a TEST DOUBLE standing in for its two hardware calls
only (allocate on the device, export with set_data_ipc): tensors live on paddle's CPU place instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import runner_client as rc
from kvcached.memory.host import create_arena, unlink
from kvcached.memory.xpu import PaddleXpuRuntime, XpuDevice, XpuUnavailable
from kvcached.protocol.layout import device_arena_bytes, device_slots
from kvcached.transfer import SwapEngine, host_pieces
from tests.conftest import DaemonFactory, shm_entries, unique_instance

SPECS = {
    "bf16": rc.CacheSpec(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4),
    "fp8": rc.CacheSpec(
        num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4, dtype="int8",
        block_wise_fp8=True,
    ),
    "mla": rc.CacheSpec(num_layers=3, kv_heads=1, head_dim=32, block_size=4, num_blocks=8, num_cpu_blocks=4, mla=True),
}  # fmt: skip
LOCAL_RANK, DEVICE_ID = 1, 0


class XpuRuntimeDouble:
    """TEST DOUBLE of ``kvcached.memory.xpu.XpuRuntime`` (there is no Kunlun XPU here): ``allocate`` makes
    the zeroed tensor on paddle's CPU place, ``export`` records the name instead of an IPC handle."""

    def __init__(self) -> None:
        self.exported: dict[str, Any] = {}

    def allocate(self, device_id: int, shape: tuple[int, ...], dtype: str) -> Any:
        import paddle

        return paddle.full(shape=list(shape), fill_value=0, dtype=dtype).cpu()

    def export(self, tensor: Any, name: str) -> None:
        assert name not in self.exported, f"{name} exported twice"
        self.exported[name] = tensor


class Backend:
    """A device tier under test: its pieces, and what a runner attached to it sees, as bytes."""

    def __init__(self, kind: str, spec: rc.CacheSpec) -> None:
        self.kind, self.spec = kind, spec
        self.exported: dict[str, Any] | None = None
        if kind == "host":
            self.name = f"/kvcached.{unique_instance()}.contract"
            self.arena = create_arena(self.name, device_arena_bytes(spec))
            self.pieces: list[Any] = list(host_pieces(spec, self.arena))
            return
        if kind == "xpu":
            if os.environ.get("KVCACHED_TEST_XPU") != "1":
                pytest.skip("no Kunlun XPU here: set KVCACHED_TEST_XPU=1 on a Kunlun host to run the xpu contract")
            runtime: Any = PaddleXpuRuntime()
        else:
            pytest.importorskip("paddle", reason="the xpu backend's code needs paddle (pip install '.[paddle]')")
            runtime = XpuRuntimeDouble()
        self.device = XpuDevice(spec, LOCAL_RANK, DEVICE_ID, runtime)
        self.pieces = list(self.device.pieces)
        self.exported = runtime.exported if isinstance(runtime, XpuRuntimeDouble) else self.device.tensors

    def seen_by_runner(self) -> list[bytes]:
        """Every tensor's bytes as an attached runner sees them, in record order."""
        if self.exported is None:  # the runner's views of the arena (device_views), slot by slot
            return [bytes(self.arena[slot.offset : slot.offset + slot.nbytes]) for slot in device_slots(self.spec)]
        import paddle

        return [paddle.view(self.exported[e.name], "uint8").numpy().tobytes() for e in self.device.exports]

    def close(self) -> None:
        if self.kind == "host":
            self.pieces.clear()
            unlink(self.name)
        else:
            self.device.close()


@pytest.fixture(params=["host", "xpu-double", "xpu"])
def backend(request: pytest.FixtureRequest) -> Iterator[Any]:
    made: list[Backend] = []

    def make(spec: str = "bf16") -> Backend:
        made.append(Backend(request.param, SPECS[spec]))
        return made[-1]

    yield make
    for b in made:
        b.close()


def random_rows(rng: np.random.Generator, count: int, width: int) -> np.ndarray[Any, Any]:
    return rng.integers(0, 256, (count, width), dtype=np.uint8)


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_fresh_tier_is_zero_and_rows_fill_the_block_record(backend: Any, spec: str) -> None:
    tier = backend(spec)
    assert sum(p.nbytes for p in tier.pieces) == SPECS[spec].block_bytes
    assert [p.column for p in tier.pieces] == list(np.cumsum([0] + [p.nbytes for p in tier.pieces])[:-1])
    for piece in tier.pieces:
        rows = piece.read(0, SPECS[spec].num_blocks)
        assert rows.dtype == np.uint8 and rows.shape == (SPECS[spec].num_blocks, piece.nbytes)
        assert not rows.any()


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_rows_written_are_read_back_and_seen_by_runners(backend: Any, spec: str) -> None:
    tier = backend(spec)
    rng = np.random.default_rng(1)
    before = tier.seen_by_runner()
    for piece in tier.pieces:
        rows = random_rows(rng, 3, piece.nbytes)
        piece.write(2, rows)
        assert np.array_equal(piece.read(2, 3), rows)
        assert not piece.read(0, 2).any() and not piece.read(5, 3).any(), "other blocks changed"
    after = tier.seen_by_runner()
    assert all(a != b for a, b in zip(after, before, strict=True)), "a runner's view does not alias the tier"


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_swap_engine_round_trip_over_the_tier(backend: Any, spec: str) -> None:
    tier = backend(spec)
    s = SPECS[spec]
    rng = np.random.default_rng(2)
    for piece in tier.pieces:
        piece.write(0, random_rows(rng, s.num_blocks, piece.nbytes))
    original = [piece.read(0, s.num_blocks).copy() for piece in tier.pieces]
    pool = bytearray(s.num_cpu_blocks * 65536 + 65536)
    engine = SwapEngine(s, tier.pieces, pool)
    engine.validate(np.array([1, 2, 6]), np.array([0, 1, 3]), src_tier="device", dst_tier="cpu")
    assert engine.swap_out(np.array([1, 2, 6]), np.array([0, 1, 3])) == 3 * s.block_bytes
    for piece in tier.pieces:
        piece.write(0, np.zeros((s.num_blocks, piece.nbytes), np.uint8))
    engine.swap_in(np.array([0, 1, 3]), np.array([4, 5, 7]))
    for piece, rows in zip(tier.pieces, original, strict=True):
        assert np.array_equal(piece.read(4, 2), rows[1:3]) and np.array_equal(piece.read(7, 1), rows[6:7])
        assert not piece.read(0, 4).any()
    record = b"".join(bytes(p) for p in engine.block_pieces(7))
    engine.write_block(0, memoryview(record))
    assert b"".join(bytes(p) for p in engine.block_pieces(0)) == record


def test_exports_match_fastdeploy_names_shapes_dtypes(backend: Any) -> None:
    for name, spec in SPECS.items():
        tier = backend(name)
        if tier.exported is None:
            continue  # host: runners map the arena, nothing is exported by name
        import paddle

        expected = rc.exports(spec, local_rank=LOCAL_RANK, device_id=DEVICE_ID)
        assert sorted(tier.exported) == sorted(e.name for e in expected)
        for e in expected:
            tensor = tier.exported[e.name]
            assert tuple(tensor.shape) == e.shape
            assert tensor.dtype == getattr(paddle, e.dtype), (e.name, tensor.dtype)


def test_xpu_memory_without_an_xpu_is_a_clear_startup_error(daemons: DaemonFactory) -> None:
    """Here there is no paddle-xpu: `--memory xpu` fails at start-up, says what to install, leaves nothing,
    and never falls back to host memory."""
    with pytest.raises(XpuUnavailable, match="paddlepaddle-xpu"):
        PaddleXpuRuntime()
    daemon = daemons.start(ranks=2, args=["--memory", "xpu", "--devices", "0,1"])
    assert daemon.exit_code(timeout=60) == 4
    assert "paddlepaddle-xpu" in daemon.log()
    assert shm_entries(daemon.instance) == []
    result = daemons.cli("start", "--instance", "kvt-never", "--memory", "xpu", "--ranks", "2", "--devices", "0")
    assert result.returncode == 4 and "--devices" in result.stderr
