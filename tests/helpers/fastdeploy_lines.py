"""Every FastDeploy line the tests can reach, checked out at run time, and an engine side for each.

``FASTDEPLOY_SRC`` names a git directory holding FastDeploy's commits (``gongshaotian/FastDeploy``: e53f5184,
41677b9a6 on ``r3_eos_2.6``, 564c78d78 on ``r3_mm_dev``). ``line_trees`` exports each commit it holds
(``git archive``: FastDeploy's ``fastdeploy/`` and its lint configuration, nothing written into that
repository) into a temporary directory of the test session, removed at its end. A plain checkout that is
not a git directory counts as the one line it is. Nothing of FastDeploy is copied into this repository.

``fastdeploy_modules`` loads one tree's ``engine_cache_queue.py``, ``ipc_signal.py``, ``cache_data.py``,
``cache_tasks.py`` and ``envs.py`` under FastDeploy's own module names (through ``tests/helpers/fastdeploy_src``),
for a test's duration, and puts back whatever tree was loaded before. ``LineEngine`` is that line's engine
side of the cache queue: its flags, its queue server where that line's engine listens, its client, and
one drop-in process per rank run against the same tree.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcached.fastdeploy.lines import KNOWN_LINES, Line, read_tree
from tests.conftest import ROOT, free_port
from tests.helpers.fastdeploy_src import pieces, source, told

#: What is exported of each commit: the package and what its pre-commit hooks read.
EXPORTED = ("fastdeploy", ".pre-commit-config.yaml", "pyproject.toml", ".flake8")
NEEDS = (
    "set FASTDEPLOY_SRC to a git clone of gongshaotian/FastDeploy holding "
    + ", ".join(line.commit for line in KNOWN_LINES)
    + " (or a checkout of one of them) to run this"
)
#: Whether each line's ENGINE serves the cache queue on the Unix socket while FD_ENGINE_TASK_QUEUE_WITH_SHM
#: is set (``engine/common_engine.py`` ``start_worker_queue_service``): e53f5184 ~475-483 always TCP;
#: 41677b9a6 ~468-474 and 564c78d78 ~467-474 the socket.
ENGINE_SOCKET = {"e53f5184": False, "41677b9a6": True, "564c78d78": True}


def _git(src: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(src), *args], capture_output=True, check=False, timeout=120)


def _export(src: Path, line: Line, into: Path) -> Path | None:
    """``git archive`` of ``line``'s commit into ``into``, or None when the repository lacks it."""
    if _git(src, "rev-parse", "--verify", "--quiet", f"{line.commit}^{{commit}}").returncode != 0:
        return None
    archive = _git(src, "archive", "--format=tar", line.commit, "--", *EXPORTED)
    if archive.returncode != 0:
        archive = _git(src, "archive", "--format=tar", line.commit, "--", "fastdeploy")
    assert archive.returncode == 0, archive.stderr.decode()
    dest = into / line.commit
    dest.mkdir()
    with tempfile.TemporaryFile() as tar:
        tar.write(archive.stdout)
        tar.seek(0)
        with tarfile.open(fileobj=tar) as opened:
            opened.extractall(dest, filter="data")
    return dest


def _copy_plain(src: Path, into: Path) -> dict[str, Path]:
    """A plain checkout of a known line (unpatched): its files copied into ``into``."""
    with contextlib.suppress(FileNotFoundError):
        tree = read_tree(src)
        if tree.line is not None and tree.patch is not None and tree.patch.verdict == "not applied":
            dest = into / tree.line.commit
            shutil.copytree(src / "fastdeploy", dest / "fastdeploy")
            for name in EXPORTED[1:]:
                if (src / name).is_file():
                    shutil.copy(src / name, dest / name)
            return {tree.line.commit: dest}
    return {}


@functools.cache
def exported() -> dict[str, Path]:
    """``{commit: tree}`` of every known line FASTDEPLOY_SRC holds, exported once per test process into a
    directory removed when the process exits; empty without FASTDEPLOY_SRC."""
    src = source()
    if src is None:
        return {}
    into = Path(tempfile.mkdtemp(prefix="kvcached-fd-lines-"))
    atexit.register(shutil.rmtree, into, ignore_errors=True)
    found = {line.commit: tree for line in KNOWN_LINES if (tree := _export(src, line, into)) is not None}
    return found or _copy_plain(src, into)


@pytest.fixture(scope="session")
def line_trees() -> dict[str, Path]:
    """``{commit: tree}`` for every known line FASTDEPLOY_SRC holds; skips, saying what it needs, if none."""
    if source() is None:
        pytest.skip(NEEDS)
    found = exported()
    if not found:
        pytest.skip(f"FASTDEPLOY_SRC={source()} holds none of them: {NEEDS}")
    return found


PATCHES = {line.commit: ROOT / "patches" / line.patch for line in KNOWN_LINES}


def apply_patch(tree: Path, commit: str, dest: Path) -> subprocess.CompletedProcess[str]:
    """A copy of ``tree`` at ``dest`` with kvcached's patch for ``commit`` applied (``git apply``, as the
    docs say); the result of ``git apply``."""
    shutil.copytree(tree, dest)
    return subprocess.run(
        ["git", "apply", str(PATCHES[commit])], cwd=dest, capture_output=True, text=True, check=False, timeout=60
    )


@functools.cache
def patched_exports() -> dict[str, Path]:
    """``{commit: tree}`` of every exported line with its kvcached patch applied (beside the export), made once
    per test process."""
    found = {}
    for commit, tree in exported().items():
        done = apply_patch(tree, commit, tree.parent / f"{commit}-patched")
        assert done.returncode == 0, f"{PATCHES[commit].name} does not apply to {commit}: {done.stderr}"
        found[commit] = tree.parent / f"{commit}-patched"
    return found


@pytest.fixture(scope="session")
def patched_trees(line_trees: dict[str, Path]) -> dict[str, Path]:
    """``{commit: tree}`` of every line present with its kvcached patch applied (beside ``line_trees``)."""
    return patched_exports()


def ipc_suffix() -> int:
    """An IPCSignal suffix (the engine worker queue port) in a range no other test draws from (60000-64999):
    ``IPCSignal(create=True)`` unlinks a segment of the same name first."""
    return 60000 + (os.getpid() * 7919 + time.monotonic_ns()) % 5000


def tree_of(line_trees: dict[str, Path], commit: str) -> Path:
    if commit not in line_trees:
        pytest.skip(f"FASTDEPLOY_SRC does not hold {commit}: {NEEDS}")
    return line_trees[commit]


@contextlib.contextmanager
def fastdeploy_modules(root: Path) -> Iterator[types.SimpleNamespace]:
    """FastDeploy's pieces (``tests.helpers.fastdeploy_src.pieces``) and its ``envs`` module from ``root``, under
    FastDeploy's module names, while the block runs; the modules loaded before are put back after."""
    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] == "fastdeploy"}
    for name in saved:
        del sys.modules[name]
    before = os.environ.get("FASTDEPLOY_SRC")
    os.environ["FASTDEPLOY_SRC"] = str(root)
    try:
        found = pieces()
        spec = importlib.util.spec_from_file_location("fastdeploy.envs", root / "fastdeploy" / "envs.py")
        assert spec is not None and spec.loader is not None
        envs = importlib.util.module_from_spec(spec)
        sys.modules["fastdeploy.envs"] = envs
        spec.loader.exec_module(envs)
        found.envs = envs
        yield found
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] == "fastdeploy"]:
            del sys.modules[name]
        sys.modules.update(saved)
        if before is None:
            os.environ.pop("FASTDEPLOY_SRC", None)
        else:
            os.environ["FASTDEPLOY_SRC"] = before


class LineEngine:
    """One FastDeploy line's engine side of the cache queue (``common_engine.py``
    ``start_worker_queue_service`` and ``prefix_cache_manager.py`` ``launch_cache_manager``), its address
    chosen as that line's engine chooses it, with FastDeploy's own ``envs`` reading the variable."""

    SIGNALS = ("cache_ready_signal", "swap_space_ready_signal", "cache_transfer_inited_signal", "cache_task_inflight")
    FLAGS = ("kv_cache_status", "cache_task_broadcast_signal", "cache_task_is_paused")

    def __init__(self, fd: types.SimpleNamespace, commit: str, tree: Path, instance: str, ranks: int) -> None:
        self.fd, self.tree, self.instance, self.ranks, self.commit = fd, tree, instance, ranks, commit
        self.suffix = ipc_suffix()
        self.port = free_port()
        socket = ENGINE_SOCKET[commit] and bool(fd.envs.FD_ENGINE_TASK_QUEUE_WITH_SHM)
        self.address: tuple[str, int] | str = (
            f"/dev/shm/fd_task_queue_{self.port}.sock" if socket else ("127.0.0.1", self.port)
        )
        self.signals: dict[str, Any] = {}
        self.dropins: list[subprocess.Popen[str]] = []
        self.server: Any = None
        try:
            for name in self.SIGNALS + self.FLAGS:
                shape = [ranks if name in self.SIGNALS else 1]
                array = np.zeros(shape, dtype=np.int32)
                self.signals[name] = fd.IPCSignal(
                    name=name, array=array, dtype=np.int32, suffix=self.suffix, create=True
                )
            self.server = fd.EngineCacheQueue(address=self.address, is_server=True, num_client=ranks, client_id=-1)
            self.queue = fd.EngineCacheQueue(address=self.address, is_server=False, num_client=ranks, client_id=0)
        except BaseException:
            self.close()
            raise

    def value(self, name: str) -> list[int]:
        return [int(v) for v in self.signals[name].value]

    def launch(self, rank: int, control: Path, args: list[str]) -> subprocess.Popen[str]:
        """The drop-in as the patched launcher starts it, reading the same FastDeploy tree."""
        full = [*args, "--rank", str(rank), "--device_id", str(rank), "--mp_num", str(self.ranks)]
        full += ["--cache_queue_port", str(self.port), "--pod_ip", "127.0.0.1"]
        full += ["--engine_worker_queue_port", str(self.suffix), *told(self.commit, self.address)]
        env = dict(os.environ, KVCACHED_INSTANCE=self.instance, FD_TEST_CONTROL_DIR=str(control))
        env["FASTDEPLOY_SRC"] = str(self.tree)
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "helpers" / "fd_dropin.py"), *full],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.dropins.append(proc)
        return proc

    def until(self, check: Any, what: str, timeout: float = 60.0) -> Any:
        """``check()`` once true (see ``Engine.until`` in tests/test_fastdeploy_engine.py)."""
        deadline = time.monotonic() + timeout
        while True:
            exited = [proc for proc in self.dropins if proc.poll() is not None]
            if got := check():
                return got
            if exited:
                output = exited[0].stdout.read() if exited[0].stdout else ""
                raise AssertionError(f"a drop-in exited ({exited[0].returncode}):\n{output}")
            assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
            time.sleep(0.005)

    def task(self, item: Any, results: int = 1) -> list[Any]:
        """Put a task and collect ``results`` done signals, as ``recv_data_transfer_result`` reads them."""
        self.queue.put_transfer_task(item)
        found: list[Any] = []

        def collect() -> bool:
            data = self.queue.get_transfer_done_signal()
            if data is not None:
                found.append(data)
            return len(found) >= results

        self.until(collect, f"the result of {item[0]}")
        return found

    def close(self) -> None:
        for proc in self.dropins:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for holder in self.signals.values():
            with contextlib.suppress(FileNotFoundError):
                holder.shm.unlink()
        if self.server is not None:
            with contextlib.suppress(Exception):
                self.server.manager.shutdown()
        if isinstance(self.address, str):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.address)
