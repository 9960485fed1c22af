"""The xpu backend's own code over a TEST DOUBLE of its hardware calls (there is no Kunlun XPU here).

``XpuRuntimeDouble`` stands in for ``kvcached.memory.xpu.XpuRuntime`` only: ``allocate`` makes the zeroed
tensor on paddle's CPU place, ``export`` records it under its name instead of an IPC handle (and, as
FastDeploy's ``set_data_ipc`` does, leaves a /dev/shm file of that name: ``xpu_multiprocess.h:50`` opens
it with O_CREAT), and ``attach`` hands the recorded tensor back (so "another process" is this one).
Registered as the test-only backend ``xpu-double``.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

from kvcached import memory
from kvcached.memory.xpu import XpuBackend


class XpuRuntimeDouble:
    """TEST DOUBLE of ``XpuRuntime``; every instance shares one table of exports, as processes share names."""

    exported: ClassVar[dict[str, Any]] = {}

    def allocate(self, device_id: int, shape: tuple[int, ...], dtype: str) -> Any:
        import paddle

        return paddle.full(shape=list(shape), fill_value=0, dtype=dtype).cpu()

    def export(self, tensor: Any, name: str) -> None:
        assert name not in self.exported, f"{name} exported twice"
        self.exported[name] = tensor
        os.close(os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_CREAT, 0o666))

    def attach(self, device_id: int, name: str, shape: tuple[int, ...], dtype: str) -> Any:
        tensor = self.exported[name]
        assert list(tensor.shape) == list(shape), (name, tensor.shape, shape)
        return tensor


class XpuDoubleBackend(XpuBackend):
    name = "xpu-double"
    summary = "TEST ONLY: the xpu backend over XpuRuntimeDouble"


memory.register(XpuDoubleBackend(runtime=XpuRuntimeDouble))
