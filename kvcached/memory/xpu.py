"""The ``xpu`` memory backend: a rank's device tier in Kunlun XPU memory, exported the way FastDeploy's
runner attaches it.

Per rank the worker allocates, on its XPU device, one paddle tensor per layer and kind (key, value,
scales), zero-filled, with FastDeploy's shapes and dtypes, and exports each under FastDeploy's name with
FastDeploy's ``set_data_ipc`` (see ``kvcached.protocol.fastdeploy``): an unmodified runner attaches with
``share_external_data(tensor, name, shape, True)``. Swaps and store tasks move block rows between those
tensors and the CPU pool with paddle copies.

Everything that needs the hardware goes through ``XpuRuntime``: its two calls, ``allocate`` (a zeroed
tensor on the device) and ``export`` (``set_data_ipc``). ``PaddleXpuRuntime`` is the real one; it checks at
start-up that paddle has XPU support and that FastDeploy's XPU ops are importable, and otherwise fails
with what to install. There is no fallback to host memory: ``--memory xpu`` without an XPU is an error.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol

import numpy as np

from kvcached.protocol.fastdeploy import Export, exports
from kvcached.protocol.spec import CacheSpec

INSTALL_HINT = (
    "install paddlepaddle-xpu (Kunlun's wheel index, matching the XPU runtime; IPC needs runtime major 5) "
    "and fastdeploy-xpu, whose fastdeploy.model_executor.ops.xpu provides set_data_ipc"
)


class XpuUnavailable(RuntimeError):
    """This host cannot run the xpu backend; the message says what is missing and what to install."""


class XpuRuntime(Protocol):
    """The hardware calls of the xpu backend."""

    def allocate(self, device_id: int, shape: tuple[int, ...], dtype: str) -> Any:
        """A zero-filled paddle tensor of ``shape`` and ``dtype`` on XPU ``device_id``."""

    def export(self, tensor: Any, name: str) -> None:
        """Make ``tensor`` attachable by other processes under ``name`` (FastDeploy's ``set_data_ipc``)."""


class PaddleXpuRuntime:
    """The real runtime: paddle on ``XPUPlace`` and FastDeploy's ``set_data_ipc``."""

    def __init__(self) -> None:
        try:
            paddle: Any = importlib.import_module("paddle")
        except ImportError as exc:
            raise XpuUnavailable(f"--memory xpu needs paddle with XPU support ({exc}): {INSTALL_HINT}") from None
        if not paddle.is_compiled_with_xpu():
            raise XpuUnavailable(f"--memory xpu: this paddle ({paddle.__version__}) has no XPU support: {INSTALL_HINT}")
        try:
            ops: Any = importlib.import_module("fastdeploy.model_executor.ops.xpu")
        except ImportError as exc:
            raise XpuUnavailable(f"--memory xpu: FastDeploy's XPU ops are missing ({exc}): {INSTALL_HINT}") from None
        self.paddle = paddle
        self.set_data_ipc = ops.set_data_ipc

    def allocate(self, device_id: int, shape: tuple[int, ...], dtype: str) -> Any:
        self.paddle.set_device(f"xpu:{device_id}")
        return self.paddle.full(shape=list(shape), fill_value=0, dtype=dtype)

    def export(self, tensor: Any, name: str) -> None:
        self.set_data_ipc(tensor, name)


class XpuPiece:
    """One exported tensor as rows of bytes, one row per block (``paddle.view`` as uint8, no copy)."""

    def __init__(self, tensor: Any, column: int, num_blocks: int) -> None:
        paddle: Any = importlib.import_module("paddle")
        self.paddle = paddle
        self.tensor = tensor
        self.rows = paddle.view(tensor, "uint8").reshape([num_blocks, -1])
        self.column = column
        self.nbytes = int(self.rows.shape[1])

    def read(self, start: int, count: int) -> np.ndarray[Any, Any]:
        rows: np.ndarray[Any, Any] = self.rows[start : start + count].numpy()
        return rows

    def write(self, start: int, rows: np.ndarray[Any, Any]) -> None:
        self.rows[start : start + len(rows)] = self.paddle.to_tensor(np.ascontiguousarray(rows), place=self.rows.place)


class XpuDevice:
    """One rank's device tier on an XPU: the tensors, their exports, and their pieces for the swap engine."""

    def __init__(self, spec: CacheSpec, local_rank: int, device_id: int, runtime: XpuRuntime) -> None:
        self.spec = spec
        self.device_id = device_id
        self.exports: list[Export] = exports(spec, local_rank, device_id)
        self.tensors: dict[str, Any] = {}
        self.pieces: list[XpuPiece] = []
        column = 0
        for export in self.exports:
            tensor = runtime.allocate(device_id, export.shape, export.dtype)
            runtime.export(tensor, export.name)
            self.tensors[export.name] = tensor
            piece = XpuPiece(tensor, column, spec.num_blocks)
            self.pieces.append(piece)
            column += piece.nbytes
        if column != spec.block_bytes:
            raise XpuUnavailable(f"xpu tensors hold {column} bytes per block, the layout needs {spec.block_bytes}")

    @property
    def nbytes(self) -> int:
        return self.spec.num_blocks * self.spec.block_bytes

    def close(self) -> None:
        """Drop the tensors (the runtime frees the memory; IPC names die with this process)."""
        self.pieces.clear()
        self.tensors.clear()
