"""The xpu backend's own code over a TEST DOUBLE of its hardware calls (there is no Kunlun XPU here).

``XpuRuntimeDouble`` stands in for ``kvcached.memory.xpu.XpuRuntime`` only: ``allocate`` makes the zeroed
tensor on paddle's CPU place, ``export`` records it under its name instead of an IPC handle (and, as
FastDeploy's ``set_data_ipc`` does, leaves a /dev/shm file of that name: ``xpu_multiprocess.h:50`` opens
it with O_CREAT), ``attach`` hands the recorded tensor back (so "another process" is this one), and
``swap_all_layers`` does what FastDeploy's op does (``custom_ops/xpu_ops/src/ops/swap_cache_batch.cc``:
its bounds checks, then per tensor each block to or from ``cpu_ptrs[i] + cpu_id * bytes per block``)
with numpy, recording each call.
Registered as the test-only backend ``xpu-double``; the tiers it makes in this process export under
FastDeploy's names, as a daemon's do.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, ClassVar

import numpy as np

from kvcached import memory
from kvcached.fastdeploy.names import TENSOR_NAMES
from kvcached.memory.xpu import XpuBackend, name_tensors


class XpuRuntimeDouble:
    """TEST DOUBLE of ``XpuRuntime``; every instance shares one table of exports, as processes share names."""

    exported: ClassVar[dict[str, Any]] = {}
    #: Each swap_all_layers call: (tensor shapes, cpu_ptrs, max_cpu_blocks, device ids, cpu ids, device, mode).
    calls: ClassVar[list[tuple[Any, ...]]] = []

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

    def swap_all_layers(
        self,
        tensors: list[Any],
        cpu_ptrs: list[int],
        max_cpu_blocks: int,
        device_ids: list[int],
        cpu_ids: list[int],
        device_id: int,
        mode: int,
    ) -> None:
        import paddle

        shapes = [tuple(t.shape) for t in tensors]
        self.calls.append((shapes, list(cpu_ptrs), max_cpu_blocks, list(device_ids), list(cpu_ids), device_id, mode))
        assert len(tensors) == len(cpu_ptrs) > 0 and len({t.dtype for t in tensors}) == 1, "one dtype per call"
        assert len(device_ids) == len(cpu_ids) and mode in (0, 1)
        for tensor, pointer in zip(tensors, cpu_ptrs, strict=True):
            blocks = tensor.shape[0]
            assert all(0 <= d < blocks for d in device_ids) and all(0 <= c < max_cpu_blocks for c in cpu_ids)
            rows = paddle.view(tensor, "uint8").reshape([blocks, -1])
            width = int(rows.shape[1])
            plane = np.ctypeslib.as_array((ctypes.c_uint8 * (max_cpu_blocks * width)).from_address(pointer))
            plane = plane.reshape(max_cpu_blocks, width)
            if mode == 0:
                plane[cpu_ids] = rows.numpy()[device_ids]
            else:
                for d, c in zip(device_ids, cpu_ids, strict=True):
                    rows[d] = paddle.to_tensor(plane[c])


class XpuDoubleBackend(XpuBackend):
    name = "xpu-double"


memory.register(XpuDoubleBackend(runtime=XpuRuntimeDouble))
name_tensors(TENSOR_NAMES)  # as ``kvcached start`` does: tiers made in a test's own process are named too
