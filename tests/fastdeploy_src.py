"""FastDeploy's pieces for the tests: its own files from the checkout ``FASTDEPLOY_SRC`` names (the cache
queue, ``IPCSignal``, ``CacheStatus`` and the storage tasks), or ``tests/fastdeploy_double.py`` without one;
and the adapter the drop-in gets in the tests, built on them.

FastDeploy's files are loaded by path under their own module names, inside a ``fastdeploy`` package shell;
``fastdeploy.utils`` is a STAND-IN offering only the loggers those files import (the real module imports
paddle). Control requests and responses and their queue are always the doubles (FastDeploy's need zmq and
its whole engine).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import types
from collections.abc import Callable
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import numpy as np

from kvcached.fastdeploy.adapter import queue_address
from kvcached.fastdeploy.lines import read_tree
from tests import fastdeploy_double as double

_QUEUE = "fastdeploy/inter_communicator/engine_cache_queue.py"
FILES = {
    "EngineCacheQueue": (_QUEUE, "fastdeploy.inter_communicator.engine_cache_queue"),
    "IPCSignal": ("fastdeploy/inter_communicator/ipc_signal.py", "fastdeploy.inter_communicator.ipc_signal"),
    "CacheStatus": ("fastdeploy/cache_manager/cache_data.py", "fastdeploy.cache_manager.cache_data"),
    "ReadStorageTask": ("fastdeploy/cache_manager/cache_tasks.py", "fastdeploy.cache_manager.cache_tasks"),
    "WriteStorageTask": ("fastdeploy/cache_manager/cache_tasks.py", "fastdeploy.cache_manager.cache_tasks"),
}


def source() -> Path | None:
    path = os.environ.get("FASTDEPLOY_SRC")
    return Path(path) if path else None


def _shell(root: Path) -> None:
    """Empty ``fastdeploy`` packages (their ``__init__`` files import the whole engine) and the stand-in
    ``fastdeploy.utils``."""
    for name in ("fastdeploy", "fastdeploy.inter_communicator", "fastdeploy.cache_manager"):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root / name.replace(".", "/"))]
            sys.modules[name] = package
    if "fastdeploy.utils" not in sys.modules:
        utils = types.ModuleType("fastdeploy.utils")
        utils.get_logger = lambda name, *_args, **_kw: logging.getLogger(name)  # type: ignore[attr-defined]
        utils.llm_logger = logging.getLogger("fastdeploy")  # type: ignore[attr-defined]
        utils.console_logger = logging.getLogger("fastdeploy")  # type: ignore[attr-defined]
        sys.modules["fastdeploy.utils"] = utils


def _load(root: Path, relative: str, module: str) -> types.ModuleType:
    if module in sys.modules:
        return sys.modules[module]
    spec = importlib.util.spec_from_file_location(module, root / relative)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[module] = loaded
    spec.loader.exec_module(loaded)
    return loaded


def pieces() -> types.SimpleNamespace:
    """FastDeploy's classes as the tests use them, and where each came from."""
    root = source()
    found: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name, (relative, module) in FILES.items():
        if root is not None:
            _shell(root)
            found[name] = getattr(_load(root, relative, module), name)
            origin[name] = f"{root / relative}"
        else:
            found[name] = getattr(double, name)
            origin[name] = "tests/fastdeploy_double.py (a double)"
    found.update(ControlRequest=double.ControlRequest, ControlResponse=double.ControlResponse, origin=origin)
    return types.SimpleNamespace(**found)


class AdapterForTests:
    """The drop-in's ``kvcached.fastdeploy.adapter.FastDeploy`` over ``pieces()``; control responses go to
    ``FMQDouble`` queues in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.fd = pieces()
        self.CacheStatus = self.fd.CacheStatus
        root = source()
        self.tree = read_tree(root) if root is not None else None  # the line, as the real adapter reads it
        self.directory = directory
        self._keep: list[Any] = []

    def cache_queue(self, address: tuple[str, int], num_client: int, client_id: int) -> Any:
        return self.fd.EngineCacheQueue(
            address=queue_address(self.tree, address),
            is_server=False,
            num_client=num_client,
            client_id=client_id,
            local_data_parallel_id=0,
        )

    def signal(self, name: str, ranks: int, suffix: int) -> np.ndarray[Any, Any]:
        holder = self.fd.IPCSignal(
            name=name, array=np.zeros([ranks], dtype=np.int32), dtype=np.int32, suffix=suffix, create=False
        )
        resource_tracker.unregister(holder.shm._name, "shared_memory")  # as the real adapter does
        self._keep.append(holder)
        value: np.ndarray[Any, Any] = holder.value
        return value

    def control_output(self, name: str) -> Callable[[Any], None]:
        return double.FMQDouble(self.directory, name).put

    def control_response(self, request_id: str, error_code: int, error_message: str) -> Any:
        return self.fd.ControlResponse(request_id, error_code, error_message)
