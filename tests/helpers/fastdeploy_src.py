"""FastDeploy's pieces for the tests: its own files from the checkout ``FASTDEPLOY_SRC`` names (the cache
queue, ``IPCSignal``, ``CacheStatus`` and the storage tasks), or ``tests/helpers/fastdeploy_double.py`` without one;
and the adapter the drop-in gets in the tests, built on them.

FastDeploy's files are imported under their own module names through the package shell of
``tests/helpers/fastdeploy_shell.py`` (its STUBS are listed there). Control requests and responses and their queue
are the doubles here (``tests/test_fastdeploy_engine_code.py`` uses FastDeploy's own, over its FMQ).
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import textwrap
import types
from collections.abc import Callable
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import numpy as np

from kvcached.fastdeploy import patchfile
from tests.helpers import fastdeploy_double as double
from tests.helpers.fastdeploy_shell import install

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


ROOT = Path(__file__).resolve().parents[2]
PATCH = ROOT / "patches" / "fastdeploy-e53f5184-kvcached.patch"
COMMIT = "e53f5184"
#: FastDeploy's configuration files its hooks read (black and isort: pyproject.toml; flake8: .flake8).
HOOK_CONFIG = ("pyproject.toml", ".flake8", ".pre-commit-config.yaml")


def told(commit: str = COMMIT, address: tuple[str, int] | str = ("127.0.0.1", 0)) -> list[str]:
    """The arguments the patched launcher of ``commit`` passes its drop-ins beyond FastDeploy's own
    (``--kvcached-line ...``), computed by the patch's own added lines (the launcher hunk, executed with
    ``KVCACHED_INSTANCE`` set and the launcher's own cache queue address ``address``, as FastDeploy forms it:
    ``(pod_ip, port)`` or the Unix socket path): what a test that plays that launcher passes."""
    path = ROOT / "patches" / f"fastdeploy-{commit}-kvcached.patch"
    hunk = next(h for h in patchfile.parse(path.read_text()) if any("--kvcached-line" in line for line in h.after))
    start = next(i for i, line in enumerate(hunk.after) if "KVCACHED_INSTANCE" in line and "=" in line)
    end = next(i for i, line in enumerate(hunk.after) if line.lstrip().startswith("entry ="))
    namespace: dict[str, Any] = {
        "os": types.SimpleNamespace(environ={"KVCACHED_INSTANCE": "set"}),
        "engine_cache_queue_address": address,
        "py_path": "cache_transfer_manager.py",
    }
    exec(textwrap.dedent("\n".join(hunk.after[start : end + 1])), namespace)
    words: list[str] = namespace["entry"].split()
    assert words[:2] == ["-m", "kvcached.fastdeploy.transfer_manager"], words
    return words[2:]


def checkout(what: str = "this") -> Path:
    """FASTDEPLOY_SRC, a checkout of e53f5184, or skip saying what ``what`` needs."""
    import pytest  # here: the drop-ins import this module, and pytest takes a while to import

    root = source()
    if root is None:
        pytest.skip(f"set FASTDEPLOY_SRC to a FastDeploy checkout of {COMMIT} (gongshaotian/FastDeploy) to run {what}")
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    if not head.stdout.startswith(COMMIT):
        pytest.skip(f"FASTDEPLOY_SRC is at {head.stdout.strip() or 'no git commit'}, {what} needs {COMMIT}")
    return root


def patched_files(patch: Path = PATCH) -> list[str]:
    return re.findall(r"^\+\+\+ b/(\S+)$", patch.read_text(), re.MULTILINE)


def patched_tree(root: Path, into: Path, patch: Path = PATCH) -> list[str]:
    """Copy the files ``patch`` touches (with their packages' ``__init__`` files and the hooks'
    configuration) from ``root`` into ``into`` and apply the patch there; the patched files."""
    files = patched_files(patch)
    packages = {str(parent / "__init__.py") for f in files for parent in Path(f).parents if parent != Path(".")}
    for relative in (*files, *HOOK_CONFIG, *sorted(packages)):  # isort tells first-party code by its packages
        (into / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / relative, into / relative)
    applied = subprocess.run(["git", "apply", str(patch)], cwd=into, capture_output=True, text=True, check=False)
    assert applied.returncode == 0, applied.stderr
    return files


def pieces() -> types.SimpleNamespace:
    """FastDeploy's classes as the tests use them, and where each came from."""
    root = source()
    found: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name, (relative, module) in FILES.items():
        if root is not None:
            install(root)
            found[name] = getattr(importlib.import_module(module), name)
            origin[name] = f"{root / relative}"
        else:
            found[name] = getattr(double, name)
            origin[name] = "tests/helpers/fastdeploy_double.py (a double)"
    found.update(ControlRequest=double.ControlRequest, ControlResponse=double.ControlResponse, origin=origin)
    return types.SimpleNamespace(**found)


class AdapterForTests:
    """The drop-in's ``kvcached.fastdeploy.adapter.FastDeploy`` over ``pieces()``; control responses go to
    ``FMQDouble`` queues in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.fd = pieces()
        self.CacheStatus = self.fd.CacheStatus
        # DOUBLE of FastDeploy's platform (``current_platform.device_name``): XPU hardware cannot exist here.
        self.platform: str | None = os.environ.get("KVCACHED_TEST_FD_PLATFORM", "xpu")
        self.directory = directory
        self._keep: list[Any] = []

    def cache_queue(self, address: tuple[str, int] | str, num_client: int, client_id: int) -> Any:
        return self.fd.EngineCacheQueue(
            address=address,
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
