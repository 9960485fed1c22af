"""The device-backend contract: what the swap engine and the runners rely on, for every registered backend.

The parameters come from the registry (``kvcached.memory.names()``). ``host`` runs here on a real shm
arena. ``xpu`` runs on a Kunlun host with ``KVCACHED_TEST_XPU=1`` (real paddle-xpu and FastDeploy ops) and
is skipped elsewhere, with the reason. Two backends exist only in the tests, each one module and one
registration: ``xpu-double`` (``tests/plugins/xpu_double.py``: the xpu backend's own code over a TEST
DOUBLE of its hardware calls) and ``testfile`` (``tests/plugins/filemem.py``: a device tier in a regular
file), which a real daemon and a real runner also use end to end.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import posix_ipc
import pytest

import runner_client as rc
import tests.plugins.filemem
import tests.plugins.xpu_double
from kvcached import memory
from kvcached.copy_engine import SwapEngine
from kvcached.fastdeploy.names import TENSOR_NAMES
from kvcached.memory.base import TierRequest
from kvcached.memory.xpu import PaddleXpuRuntime, exports
from kvcached.protocol.errors import BackendUnavailable
from tests.conftest import (
    ROOT,
    DaemonFactory,
    run_runner,
    runner_result,
    shm_entries,
    unique_devices,
    unique_instance,
)

SPECS = {
    "bf16": rc.CacheSpec(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4),
    "fp8": rc.CacheSpec(
        num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4, dtype="int8",
        block_wise_fp8=True,
    ),
    "mla": rc.CacheSpec(num_layers=3, kv_heads=1, head_dim=32, block_size=4, num_blocks=8, num_cpu_blocks=4, mla=True),
    "mtp": rc.CacheSpec(
        num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4, mtp_layers=1,
        mtp_num_blocks=12,
    ),
}  # fmt: skip
LOCAL_RANK, DEVICE_ID = 1, 0
PLUGINS = (tests.plugins.filemem.__name__, tests.plugins.xpu_double.__name__)


class Tier:
    """A device tier under test, made by its backend as a worker would, and attached as a runner would."""

    def __init__(self, name: str, spec: rc.CacheSpec, tmp_path: Path) -> None:
        if name == "xpu" and os.environ.get("KVCACHED_TEST_XPU") != "1":
            pytest.skip("no Kunlun XPU here: set KVCACHED_TEST_XPU=1 on a Kunlun host to run the xpu contract")
        if name.startswith("xpu"):
            pytest.importorskip("paddle", reason="the xpu backend's code needs paddle (pip install '.[paddle]')")
            tests.plugins.xpu_double.XpuRuntimeDouble.exported.clear()
        os.environ["KVCACHED_TEST_FILEMEM_DIR"] = str(tmp_path)
        self.backend = memory.get(name)
        self.spec = spec
        self.request = TierRequest(
            instance=unique_instance(), arena_id=1, rank=LOCAL_RANK, spec=spec, device_id=DEVICE_ID
        )
        self.tier = self.backend.create(self.request, lambda done: None)
        self.pieces = self.tier.pieces
        self.framework = "paddle" if name.startswith("xpu") else "numpy"

    def seen_by_runner(self) -> list[bytes]:
        """Every tensor's bytes as an attached runner sees them, in record order."""
        attached = self.backend.attach(self.spec, self.tier.descriptor, LOCAL_RANK, self.framework, owner=os.geteuid())
        try:
            tensors = [t for layer in zip(*_per_layer(attached.tensors), strict=True) for t in layer]
            if self.framework == "paddle":
                import paddle

                return [paddle.view(t, "uint8").numpy().tobytes() for t in tensors]
            return [t.view(np.uint8).tobytes() for t in tensors]
        finally:
            attached.close()

    def close(self) -> None:
        self.tier.close()
        self.backend.release(self.request)
        with contextlib.suppress(posix_ipc.ExistentialError):  # a backend without a shm arena
            posix_ipc.unlink_shared_memory(self.request.shm_name("dev"))


def _per_layer(tensors: dict[str, list[Any]]) -> list[list[Any]]:
    """The kinds a spec has, each a list by layer, in record order (key, value, key scale, value scale)."""
    return [tensors[kind] for kind in ("key", "value", "key_scale", "value_scale") if tensors[kind]]


@pytest.fixture(params=memory.names())
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    made: list[Tier] = []

    def make(spec: str = "bf16") -> Tier:
        made.append(Tier(request.param, SPECS[spec], tmp_path))
        return made[-1]

    yield make
    for tier in made:
        tier.close()


def test_registry_lists_the_built_in_and_the_test_only_backends() -> None:
    """Adding a backend is one module and one registration: the test-only ones are listed beside the built-in."""
    assert {"host", "xpu", "xpu-double", "testfile"} <= set(memory.names())
    with pytest.raises(rc.InvalidSpec, match="known: host, xpu"):
        memory.get("nvme")


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
def test_a_tier_has_the_bytes_its_backend_tells_runners_to_expect(backend: Any, spec: str) -> None:
    """A tier's bytes (what its record publishes) are its backend's ``arena_bytes`` (what a runner checks
    them against) and hold every tensor a runner attaches, MTP layers of more blocks than the model's
    included (the xpu tier once counted ``num_blocks`` blocks for every layer)."""
    tier = backend(spec)
    s = SPECS[spec]
    assert tier.tier.nbytes == tier.backend.arena_bytes(s)
    assert tier.tier.nbytes >= s.device_bytes == sum(len(view) for view in tier.seen_by_runner())
    assert sum(p.nbytes * len(p.read(0, 1 << 20)) for p in tier.pieces) == s.device_bytes


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
    assert b"".join(after) != b"".join(before)


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
    staging = np.zeros((2, s.block_bytes), np.uint8)  # the store's staging rows: whole block records
    engine.copy_out(np.array([7]), np.array([1]), staging)
    engine.copy_in(np.array([1]), np.array([0]), staging)
    for piece in tier.pieces:
        assert np.array_equal(piece.read(0, 1), piece.read(7, 1))
    assert staging[1].tobytes() == b"".join(piece.read(7, 1).tobytes() for piece in tier.pieces)


def test_xpu_double_exports_fastdeploy_names_shapes_dtypes(tmp_path: Path) -> None:
    """The xpu backend exports one tensor per layer and kind under FastDeploy's name, shape and dtype."""
    paddle = pytest.importorskip("paddle", reason="the xpu backend's code needs paddle (pip install '.[paddle]')")
    for name, spec in SPECS.items():
        tier = Tier("xpu-double", spec, tmp_path)
        try:
            exported = tests.plugins.xpu_double.XpuRuntimeDouble.exported
            expected = exports(spec, TENSOR_NAMES, local_rank=LOCAL_RANK, device_id=DEVICE_ID)
            assert sorted(exported) == sorted(e.name for e in expected), name
            for e in expected:
                assert tuple(exported[e.name].shape) == e.shape
                assert exported[e.name].dtype == getattr(paddle, e.dtype), (e.name, exported[e.name].dtype)
        finally:
            tier.close()


def test_test_only_backend_serves_a_real_daemon_and_runner(daemons: DaemonFactory, tmp_path: Path) -> None:
    """A backend from a plugin module: the daemon allocates with it, a runner process attaches through the
    registry and swaps, and the daemon's stop releases its files."""
    env = daemons.env(KVCACHED_PLUGINS=",".join(PLUGINS), KVCACHED_TEST_FILEMEM_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    daemon = daemons.start(ranks=2, args=["--memory", "testfile"], env=env)
    status = daemon.wait_ready()
    assert sorted(p.name for p in tmp_path.glob("*.dev")) == sorted(
        f"{daemon.instance}.{status['generation']}.r{r}.dev" for r in range(2)
    )
    spec = dict(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4)
    result = runner_result(run_runner(env, instance=daemon.instance, rank=1, spec=spec, swap_rounds=3))
    assert result["ok"] and result["owner"] == "daemon" and result["swap_ok"], result
    assert result["mapping"].endswith(".r1.dev") and str(tmp_path) in result["mapping"]
    assert daemon.stop() == 0
    assert list(tmp_path.glob("*.dev")) == [] and shm_entries(daemon.instance) == []


def test_xpu_ipc_records_are_removed_at_stop_and_reclaimed_after_kill9(daemons: DaemonFactory) -> None:
    """--memory xpu: the /dev/shm records set_data_ipc leaves (one per exported tensor) outlive a kill -9,
    doctor lists them and the next start reclaims them; they are removed when the daemon stops (the xpu
    backend's own code, over its runtime double)."""
    pytest.importorskip("paddle", reason="the xpu backend's code needs paddle (pip install '.[paddle]')")
    env = daemons.env(KVCACHED_PLUGINS=",".join(PLUGINS), PYTHONPATH=str(ROOT))
    devices = unique_devices(2)
    args = ["--memory", "xpu-double", "--devices", ",".join(map(str, devices))]
    daemon = daemons.start(ranks=2, args=args, env=env)
    daemon.wait_ready(timeout=60)
    spec = rc.CacheSpec(num_layers=2, kv_heads=2, head_dim=16, block_size=4, num_blocks=8, num_cpu_blocks=4)
    records = [Path("/dev/shm") / e.name for rank in (0, 1) for e in exports(spec, TENSOR_NAMES, rank, devices[rank])]
    assert len(records) == 8 and all(p.exists() for p in records)
    daemon.kill9()
    assert all(p.exists() for p in records), "a killed run leaves them"
    doctor = daemons.cli("doctor", "--json", "--instance", daemon.instance, "--ranks", "2", *args, env=env)
    listed = next(c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "leftovers")["measured"]["objects"]
    assert {str(p) for p in records} <= set(listed)
    daemon = daemons.start(daemon.instance, ranks=2, args=args, env=env)
    daemon.wait_ready(timeout=60)
    assert '"reclaimed objects of an earlier run"' in daemon.log()  # the CPU pools are adopted, the records not
    assert all(p.exists() for p in records), "the new worker exports the device tier it made anew"
    assert daemon.stop() == 0 and not any(p.exists() for p in records)


def test_xpu_memory_without_an_xpu_is_a_clear_startup_error(daemons: DaemonFactory) -> None:
    """Here there is no paddle-xpu: `--memory xpu` fails at start-up, says what to install, leaves nothing,
    and never falls back to host memory."""
    with pytest.raises(BackendUnavailable, match="paddlepaddle-xpu"):
        PaddleXpuRuntime()
    daemon = daemons.start(ranks=2, args=["--memory", "xpu", "--devices", "0,1"])
    assert daemon.exit_code(timeout=60) == 4
    assert "paddlepaddle-xpu" in daemon.log()
    assert shm_entries(daemon.instance) == []
    result = daemons.cli("start", "--instance", "kvt-never", "--memory", "xpu", "--ranks", "2", "--devices", "0")
    assert result.returncode == 4 and "--devices" in result.stderr
