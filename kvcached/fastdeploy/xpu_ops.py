"""FastDeploy's XPU ops, the calls the ``xpu`` device backend (``kvcached.memory.xpu``) makes on a Kunlun
host: ``set_data_ipc`` (export a tensor under a name), ``share_external_data`` (attach one by name) and
``swap_cache_all_layers`` (device blocks to and from a pinned host pool), from
``fastdeploy.model_executor.ops.xpu``, with paddle on ``XPUPlace``.

``PaddleXpuRuntime`` is the real ``kvcached.memory.xpu.XpuRuntime``: it checks that paddle has XPU
support and that FastDeploy's ops import, and otherwise raises ``BackendUnavailable`` saying what to
install. Nothing here is imported before a daemon or a runner uses the xpu backend.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from kvcached.protocol.errors import BackendUnavailable
from kvcached.protocol.names import SHM_DIR

OPS_MODULE = "fastdeploy.model_executor.ops.xpu"
#: The ops a runner and the daemon need to share tensors.
SHARING_OPS = ("set_data_ipc", "share_external_data")
INSTALL_HINT = (
    "install paddlepaddle-xpu (Kunlun's wheel index, matching the XPU runtime; IPC needs runtime major 5) "
    f"and fastdeploy-xpu, whose {OPS_MODULE} provides set_data_ipc"
)


def ipc_record(name: str) -> Path:
    """The file ``set_data_ipc`` leaves in /dev/shm for the tensor it exported under ``name``
    (``custom_ops/xpu_ops/src/ops/xpu_multiprocess.h:50`` opens it with O_CREAT): it outlives the process
    that exported, so whoever exported removes it."""
    return SHM_DIR / name


def _import_paddle_xpu() -> tuple[Any, Any]:
    try:
        paddle: Any = importlib.import_module("paddle")
    except ImportError as exc:
        raise BackendUnavailable(f"--memory xpu needs paddle with XPU support ({exc}): {INSTALL_HINT}") from None
    if not paddle.is_compiled_with_xpu():
        raise BackendUnavailable(f"--memory xpu: this paddle ({paddle.__version__}) has no XPU support: {INSTALL_HINT}")
    try:
        ops: Any = importlib.import_module(OPS_MODULE)
    except ImportError as exc:
        raise BackendUnavailable(f"--memory xpu: FastDeploy's XPU ops are missing ({exc}): {INSTALL_HINT}") from None
    return paddle, ops


class PaddleXpuRuntime:
    """The real runtime: paddle on ``XPUPlace`` and FastDeploy's XPU ops."""

    def __init__(self) -> None:
        self.paddle, self.ops = _import_paddle_xpu()

    def allocate(self, device_id: int, shape: tuple[int, ...], dtype: str) -> Any:
        self.paddle.set_device(f"xpu:{device_id}")
        return self.paddle.full(shape=list(shape), fill_value=0, dtype=dtype)

    def export(self, tensor: Any, name: str) -> None:
        self.ops.set_data_ipc(tensor, name)

    def attach(self, device_id: int, name: str, shape: tuple[int, ...], dtype: str) -> Any:
        self.paddle.set_device(f"xpu:{device_id}")
        empty = self.paddle.empty(shape=[], dtype=dtype)
        # use_ipc=False, as FastDeploy's XPU runner attaches (worker/xpu_model_runner.py:1280 at e53f5184):
        # the op then wraps the exporter's raw device pointer from the shm record instead of opening an
        # XPU IPC handle (custom_ops/xpu_ops/src/ops/share_external_data.cc:31-42).
        return self.ops.share_external_data(empty, name, list(shape), False)

    def swap_all_layers(  # noqa: PLR0917 - FastDeploy's op, argument for argument
        self,
        tensors: list[Any],
        cpu_ptrs: list[int],
        max_cpu_blocks: int,
        device_ids: list[int],
        cpu_ids: list[int],
        device_id: int,
        mode: int,
    ) -> None:
        # The op FastDeploy's transfer manager calls (cache_manager/cache_transfer_manager.py:1349 at
        # e53f5184), with the same arguments: its PD_BUILD_OP(swap_cache_all_layers) in swap_cache_batch.cc.
        self.ops.swap_cache_all_layers(tensors, cpu_ptrs, max_cpu_blocks, device_ids, cpu_ids, device_id, mode)


def ops_present() -> dict[str, bool] | str:
    """Which of ``SHARING_OPS`` FastDeploy's XPU ops module has, or why it does not import."""
    try:
        ops = importlib.import_module(OPS_MODULE)
    except ImportError as exc:
        return str(exc)
    return {name: hasattr(ops, name) for name in SHARING_OPS}
