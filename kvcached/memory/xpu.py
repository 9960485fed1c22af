"""The ``xpu`` device backend: a rank's device tier in Kunlun XPU memory, exported under names a runner attaches by.

Per rank the worker allocates, on its XPU device, one zero-filled paddle tensor per layer and kind (key, value,
scales) and exports each under a name (``set_data_ipc``). The names are data this backend is given (``name_tensors``;
the CLI gives FastDeploy's, so that FastDeploy's own processes find the tensors) and publishes in each rank's
descriptor, so a runner attaches (``share_external_data``) by the names the daemon used: ``{"device": d,
"local_rank": r, "pid": p, "names": {kind: template}}`` (``pid`` is the worker that allocated the tensors, so a tier
made anew never publishes the descriptor of the one before it).

Swaps between the tensors and the CPU pool are one call of the XPU ops' ``swap_cache_all_layers`` per tensor kind
(key, value, scales), straight between device memory and the pool, which for that is laid out in planes
(``kvcached.protocol.layout``), one per tensor, each layer's CPU blocks at the device block's stride. What it costs: a
block's record for the attention store is gathered from every plane (one copy per tensor instead of one per block),
and store tasks still go through host arrays (``XpuPiece.read``/``write``).

Everything that needs the hardware goes through ``XpuRuntime``; the real one (``PaddleXpuRuntime``, paddle on
``XPUPlace``) takes ``set_data_ipc``, ``share_external_data`` and ``swap_cache_all_layers`` from FastDeploy's XPU build
and fails with what to install when paddle or those ops do not import. No fallback to host memory: ``--memory xpu``
without an XPU is an error. Device memory does not outlive the worker process that allocated it: a replaced worker, or a
daemon adopting an earlier one's memory, makes the device tier anew (zeroed); the CPU pool and the store (host memory,
disk) are kept."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
import os
import string
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvcached.checks import FAIL, OK, Check
from kvcached.memory import register
from kvcached.memory.base import Attached, DeviceBackend, DeviceTier, Piece, Progress, TierRequest, TierSwap
from kvcached.protocol.errors import BackendUnavailable, InvalidArgument, ProtocolError
from kvcached.protocol.layout import PLANES, cpu_planes, device_slots
from kvcached.protocol.names import PREFIX, SHM_DIR
from kvcached.protocol.spec import CacheSpec
from kvcached.protocol.trust import check_owner

OPS_MODULE = "fastdeploy.model_executor.ops.xpu"
#: The ops a runner and the daemon need to share tensors.
SHARING_OPS = ("set_data_ipc", "share_external_data")
INSTALL_HINT = (
    "install paddlepaddle-xpu (Kunlun's wheel index, matching the XPU runtime; IPC needs runtime major 5) "
    f"and fastdeploy-xpu, whose {OPS_MODULE} provides set_data_ipc"
)
#: Every tensor kind a tier may hold, each needing a name template.
KINDS = ("key", "value", "key_scale", "value_scale")
#: The names this process's tiers export under (``name_tensors``); None until given.
_templates: dict[str, str] | None = None


def name_tensors(templates: Mapping[str, str]) -> None:
    """Name the tensors this process's xpu tiers export: one template per kind (``_checked``; ``{rank}`` is the local
    rank). The daemon's entry point gives them before any tier is made; runners read them from the rank's descriptor."""
    global _templates
    _templates = _checked(templates)


#: The fields a name template may use, each plainly (``{layer}``: no index, attribute, conversion or format).
FIELDS = frozenset({"layer", "rank", "device"})
#: Longest name a template may give (a file name in /dev/shm).
MAX_NAME = 200


def _checked(templates: object) -> dict[str, str]:
    """``templates`` as one name template per kind, each with ``{layer}`` and ``{rank}`` (so that no two tensors share a
    name) and no field but ``FIELDS``, giving a file name that is not one of kvcached's own. Raises ``InvalidArgument``
    naming ``names`` for anything else (whatever it is: a descriptor may be garbage)."""
    if not isinstance(templates, Mapping) or set(templates) != set(KINDS):
        got = sorted(map(str, templates)) if isinstance(templates, Mapping) else type(templates).__name__
        raise InvalidArgument("names", f"one template per tensor kind {list(KINDS)}; got {got}")
    for kind, template in templates.items():
        if not isinstance(template, str):
            raise InvalidArgument("names", f"{kind}: a template is a string, got {type(template).__name__}")
        try:
            fields = {(field, spec, conversion) for _, field, spec, conversion in string.Formatter().parse(template)}
        except ValueError as exc:
            raise InvalidArgument("names", f"{kind}: {template[:80]!r}: {exc}") from None
        used = {field for field, _, _ in fields if field is not None}
        plain = all(not spec and conversion is None for field, spec, conversion in fields if field is not None)
        name = template.format(layer=0, rank=0, device=0) if used <= FIELDS and plain else ""
        # A name for a file of its own in /dev/shm: printable, no '/', not a dot name, not in kvcached's names.
        own_file = 0 < len(name) <= MAX_NAME and name.isprintable() and not name.startswith((".", PREFIX, "sem."))
        if not (plain and {"layer", "rank"} <= used <= FIELDS and own_file and "/" not in name):
            raise InvalidArgument(
                "names",
                f"{kind}: {template[:80]!r} must use {{layer}} and {{rank}} (and may use {{device}}), nothing else, "
                f"and give a file name of at most {MAX_NAME} characters that is not kvcached's",
            )
    return {kind: str(templates[kind]) for kind in KINDS}


@dataclasses.dataclass(frozen=True, slots=True)
class Export:
    """One tensor of a tier as it is exported: its name, kind, layer, shape and dtype."""

    name: str
    kind: str
    layer: int
    shape: tuple[int, ...]
    dtype: str


def exports(spec: CacheSpec, templates: Mapping[str, str], local_rank: int, device_id: int) -> list[Export]:
    """Every tensor of one rank, in layer order (the model's layers, then the MTP layers): key, value, key scale, value
    scale per layer, each named by its kind's template."""
    made: list[Export] = []
    for slot in device_slots(spec):
        name = templates[slot.kind].format(layer=slot.layer, rank=local_rank, device=device_id)
        made.append(Export(name, slot.kind, slot.layer, slot.shape, slot.dtype))
    return made


def ipc_record(name: str) -> Path:
    """The file ``set_data_ipc`` leaves in /dev/shm for the tensor it exported under ``name``: it outlives the exporter,
    which removes it (``custom_ops/xpu_ops/src/ops/xpu_multiprocess.h:50`` opens it with O_CREAT)."""
    return SHM_DIR / name


class XpuRuntime(Protocol):
    """The hardware calls of the xpu backend."""

    def allocate(self, device_id: int, shape: tuple[int, ...], dtype: str) -> Any:
        """A zero-filled paddle tensor of ``shape`` and ``dtype`` on XPU ``device_id``."""

    def export(self, tensor: Any, name: str) -> None:
        """Make ``tensor`` attachable by other processes under ``name`` (FastDeploy's ``set_data_ipc``)."""

    def attach(self, device_id: int, name: str, shape: tuple[int, ...], dtype: str) -> Any:
        """The tensor another process exported under ``name`` (FastDeploy's ``share_external_data``)."""

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
        """FastDeploy's ``swap_cache_all_layers`` (``custom_ops/xpu_ops/src/ops/swap_cache_batch.cc``): per tensor
        ``i``, copies between block ``device_ids[k]`` and the host block at ``cpu_ptrs[i] + cpu_ids[k] * (i's bytes per
        block)``, one ``xpu_memcpy`` per run of ids; mode 0 device to host, 1 host to device; one dtype per call."""


class PaddleXpuRuntime:
    """The real runtime: paddle on ``XPUPlace`` and the XPU ops of ``OPS_MODULE``."""

    def __init__(self) -> None:
        try:
            self.paddle: Any = importlib.import_module("paddle")
        except ImportError as exc:
            raise BackendUnavailable(f"--memory xpu needs paddle with XPU support ({exc}): {INSTALL_HINT}") from None
        if not self.paddle.is_compiled_with_xpu():
            version = self.paddle.__version__
            raise BackendUnavailable(f"--memory xpu: this paddle ({version}) has no XPU support: {INSTALL_HINT}")
        try:
            self.ops: Any = importlib.import_module(OPS_MODULE)
        except ImportError as exc:
            raise BackendUnavailable(f"--memory xpu: the XPU ops are missing ({exc}): {INSTALL_HINT}") from None

    def allocate(self, device_id: int, shape: tuple[int, ...], dtype: str) -> Any:
        self.paddle.set_device(f"xpu:{device_id}")
        return self.paddle.full(shape=list(shape), fill_value=0, dtype=dtype)

    def export(self, tensor: Any, name: str) -> None:
        self.ops.set_data_ipc(tensor, name)

    def attach(self, device_id: int, name: str, shape: tuple[int, ...], dtype: str) -> Any:
        self.paddle.set_device(f"xpu:{device_id}")
        empty = self.paddle.empty(shape=[], dtype=dtype)
        # use_ipc=False, as FastDeploy's XPU runner attaches (worker/xpu_model_runner.py:1280 at e53f5184): the op then
        # wraps the exporter's raw device pointer from the shm record instead of opening an XPU IPC handle
        # (custom_ops/xpu_ops/src/ops/share_external_data.cc:31-42).
        return self.ops.share_external_data(empty, name, list(shape), False)

    def swap_all_layers(  # noqa: PLR0917 - the op's arguments, in order
        self,
        tensors: list[Any],
        cpu_ptrs: list[int],
        max_cpu_blocks: int,
        device_ids: list[int],
        cpu_ids: list[int],
        device_id: int,
        mode: int,
    ) -> None:
        # The op FastDeploy's transfer manager calls (cache_manager/cache_transfer_manager.py:1349 at e53f5184), with
        # the same arguments: its PD_BUILD_OP(swap_cache_all_layers) in swap_cache_batch.cc.
        self.ops.swap_cache_all_layers(tensors, cpu_ptrs, max_cpu_blocks, device_ids, cpu_ids, device_id, mode)


class XpuPiece:
    """One exported tensor as rows of bytes, one row per block (``paddle.view`` as uint8, no copy)."""

    def __init__(self, tensor: Any, column: int, num_blocks: int) -> None:
        self.paddle: Any = importlib.import_module("paddle")
        self.rows = self.paddle.view(tensor, "uint8").reshape([num_blocks, -1])
        self.column = column
        self.nbytes = int(self.rows.shape[1])

    def read(self, start: int, count: int) -> np.ndarray[Any, Any]:
        rows: np.ndarray[Any, Any] = self.rows[start : start + count].numpy()
        return rows

    def write(self, start: int, rows: np.ndarray[Any, Any]) -> None:
        self.rows[start : start + len(rows)] = self.paddle.to_tensor(np.ascontiguousarray(rows), place=self.rows.place)

    def host(self) -> None:
        return None  # device memory: the copy engine goes through read/write (or the tier's pool_swap)


class XpuTier(DeviceTier):
    """One rank's device tier on an XPU: the tensors, their exports, and their pieces."""

    def __init__(
        self, spec: CacheSpec, local_rank: int, device_id: int, runtime: XpuRuntime, names: Mapping[str, str]
    ) -> None:
        self.spec = spec
        self.runtime = runtime
        self.device_id = device_id
        self.descriptor = {"device": device_id, "local_rank": local_rank, "pid": os.getpid(), "names": dict(names)}
        self.nbytes = spec.device_bytes
        self.exports: list[Export] = exports(spec, names, local_rank, device_id)
        self.tensors: dict[str, Any] = {}
        self.pieces: list[Piece] = []
        column = 0
        for export in self.exports:
            tensor = runtime.allocate(device_id, export.shape, export.dtype)
            runtime.export(tensor, export.name)
            self.tensors[export.name] = tensor
            piece = XpuPiece(tensor, column, export.shape[0])
            self.pieces.append(piece)
            column += piece.nbytes
        if column != spec.block_bytes:
            raise BackendUnavailable(f"xpu tensors hold {column} bytes per block, the layout needs {spec.block_bytes}")

    def pool_swap(self, pool: Any) -> TierSwap:
        """``swap_cache_all_layers`` between the tensors and the pool's planes: one call per tensor kind present (key,
        value, scales), as FastDeploy's transfer manager makes them, each plane standing for a per-layer CPU buffer."""
        base = ctypes.addressof(ctypes.c_char.from_buffer(pool))  # dropped at once (a live export blocks unmapping)
        kinds: dict[str, tuple[list[Any], list[int]]] = {}
        for export, (offset, _) in zip(self.exports, cpu_planes(self.spec), strict=True):
            tensors, pointers = kinds.setdefault(export.kind, ([], []))
            tensors.append(self.tensors[export.name])
            pointers.append(base + offset)
        count = self.spec.num_cpu_blocks

        def swap(direction: str, device_ids: np.ndarray[Any, Any], cpu_ids: np.ndarray[Any, Any]) -> None:
            mode = 0 if direction == "out" else 1
            dev, cpu = device_ids.tolist(), cpu_ids.tolist()
            for tensors, pointers in kinds.values():
                self.runtime.swap_all_layers(tensors, pointers, count, dev, cpu, self.device_id, mode)

        return swap

    def close(self) -> None:
        """Drop the tensors (the runtime frees the memory when this process lets go of them)."""
        self.pieces.clear()
        self.tensors.clear()


class XpuAttached(Attached):
    """A runner's attached XPU tensors."""

    def __init__(self, tensors: dict[str, list[Any]]) -> None:
        self.tensors = tensors
        self.nbytes = 0

    def close(self) -> None:
        self.tensors = {kind: [] for kind in self.tensors}


class XpuBackend(DeviceBackend):
    """See the module docstring. ``runtime`` makes the hardware adapter (a double in tests)."""

    name = "xpu"
    pins_pool = True
    pool_layout = PLANES
    swaps_itself = True

    def __init__(self, runtime: Callable[[], XpuRuntime] = PaddleXpuRuntime) -> None:
        self.runtime = runtime

    def arena_bytes(self, spec: CacheSpec) -> int:
        """The tensors' bytes (device memory has no page padding to count)."""
        return spec.device_bytes

    def create(self, request: TierRequest, progress: Progress) -> DeviceTier:
        if _templates is None:
            raise BackendUnavailable("xpu: no names to export the tensors under (the daemon's entry point gives them)")
        tier = XpuTier(request.spec, request.rank, request.device_id, self.runtime(), _templates)
        progress(tier.nbytes)
        return tier

    def leftovers(self, spec: CacheSpec, descriptor: Mapping[str, Any]) -> list[Path]:
        """The /dev/shm records ``set_data_ipc`` writes, one per exported tensor (``ipc_record``), removed by the daemon
        at stop and by a start after a killed run; named by the descriptor, else by this process's templates."""
        device, local_rank = descriptor.get("device"), descriptor.get("local_rank")
        if not isinstance(device, int) or not isinstance(local_rank, int):
            return []
        try:
            names = _checked(descriptor.get("names", _templates))
        except InvalidArgument:
            return []
        records = [ipc_record(export.name) for export in exports(spec, names, local_rank, device)]
        return [record for record in records if record.exists()]

    def attach(
        self, spec: CacheSpec, descriptor: Mapping[str, Any], local_rank: int, framework: str, *, owner: int
    ) -> Attached:
        if framework != "paddle":
            raise InvalidArgument("framework", "this daemon keeps the cache in XPU memory: use framework='paddle'")
        device = descriptor.get("device")
        if not isinstance(device, int):
            raise ProtocolError(f"rank {local_rank}: xpu descriptor {dict(descriptor)} lacks the device")
        try:
            names = _checked(descriptor.get("names"))
        except InvalidArgument as exc:
            raise ProtocolError(f"rank {local_rank}: xpu descriptor {dict(descriptor)}: {exc}") from None
        try:
            runtime = self.runtime()
        except BackendUnavailable as exc:
            raise InvalidArgument("framework", f"attaching an xpu cache: {exc}") from None
        tensors: dict[str, list[Any]] = {"key": [], "value": [], "key_scale": [], "value_scale": []}
        for export in exports(spec, names, local_rank, device):
            record = ipc_record(export.name)
            with contextlib.suppress(FileNotFoundError):  # set_data_ipc's record of the handle; absent: attach fails
                check_owner(f"IPC record {record}", os.stat(record), owner=owner)
            tensors[export.kind].append(runtime.attach(device, export.name, export.shape, export.dtype))
        return XpuAttached(tensors)

    def doctor(self, spec: CacheSpec, ranks: int) -> list[Check]:
        """Always three checks: ``xpu_paddle`` (paddle with XPU support), ``xpu_runtime`` (the XPU runtime's major
        version: IPC needs 5) and ``xpu_ops`` (FastDeploy's XPU ops)."""
        try:
            paddle: Any = importlib.import_module("paddle")
        except ImportError as exc:
            paddle = None
            advice = "pip install paddlepaddle-xpu from Kunlun's wheel index (not on PyPI)"
            checks = [Check("xpu_paddle", FAIL, f"paddle not importable ({exc})", {"paddle": None}, advice)]
        else:
            compiled = bool(paddle.is_compiled_with_xpu())
            measured = {"paddle": paddle.__version__, "compiled_with_xpu": compiled}
            figure = f"paddle {paddle.__version__} {'with' if compiled else 'without'} XPU support"
            advice = "" if compiled else "this is the CPU paddle: install paddlepaddle-xpu"
            checks = [Check("xpu_paddle", OK if compiled else FAIL, figure, measured, advice)]
        version = None
        for getter in ("xpu_xre", "xpu"):
            with contextlib.suppress(AttributeError, TypeError):
                version = str(getattr(paddle.version, getter)())
                break
        major = int(version.split(".")[0]) if version and version.split(".")[0].isdigit() else None
        measured_rt = {"runtime": version, "major": major}
        if major is None:
            figure = "no XPU runtime" + (f": paddle.version.{getter}() says {version}" if version else "")
            checks.append(Check("xpu_runtime", FAIL, figure, measured_rt, "install the XPU runtime (XRE)"))
        else:
            advice = "IPC handles need runtime major version 5" if major < 5 else ""
            verdict = FAIL if major < 5 else OK
            checks.append(Check("xpu_runtime", verdict, f"XPU runtime {version}", measured_rt, advice))
        try:
            ops = importlib.import_module(OPS_MODULE)
        except ImportError as exc:
            figure = f"FastDeploy XPU ops missing ({exc})"
            checks.append(Check("xpu_ops", FAIL, figure, {"ops": {}}, "pip install fastdeploy-xpu"))
            return checks
        present = {name: hasattr(ops, name) for name in SHARING_OPS}
        figure = ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in present.items())
        checks.append(Check("xpu_ops", OK if all(present.values()) else FAIL, figure, {"ops": present}))
        return checks


register(XpuBackend())
