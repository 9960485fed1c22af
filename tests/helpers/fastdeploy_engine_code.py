"""Machinery for the tests that drive FastDeploy's own engine code (``tests/helpers/fd_engine.py``) against the drop-in
and a real daemon, on each FastDeploy line: its patched tree, the engine process and its commands, the runner's
views. The drop-ins the engine launches are given a FastDeploy that holds only the modules they import, without
their sources (``tests.helpers.fastdeploy_shell.dropin_package``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import runner_client as rc
from tests.conftest import ROOT, DaemonFactory, free_port
from tests.helpers.fastdeploy_lines import ENGINE_SOCKET, NEEDS, PATCHES, exported
from tests.helpers.fastdeploy_shell import dropin_package
from tests.helpers.fastdeploy_src import checkout, patched_tree, source
from tests.helpers.shared_daemons import shared_daemons

#: A realistic geometry: 16 layers, 2 ranks, a file store.
GEOMETRY = {"tp": 2, "layers": 16, "kv_heads": 2, "head_dim": 64, "block_size": 16, "blocks": 64, "cpu_blocks": 32}
#: The lines whose engine code the tests drive.
COMMITS = tuple(ENGINE_SOCKET)
#: The drop-ins' logs as the lines' launchers name them: ``launch_cache_transfer_manager_<device>.log`` (e53f5184,
#: 41677b9a6), ``cache_manager_<device>.log`` (564c78d78).
DROPIN_LOGS = "*cache*manager_*.log"


def fastdeploy_checkout() -> Path:
    """FASTDEPLOY_SRC at e53f5184 with pyzmq (FastDeploy's FMQ) importable, or skip saying what is missing."""
    root = checkout("the tests that drive FastDeploy's engine code")
    pytest.importorskip("zmq", reason="FastDeploy's FMQ (control responses) needs pyzmq")
    return root


def fastdeploy_line(commit: str) -> Path:
    """The tree of FastDeploy line ``commit`` (exported from FASTDEPLOY_SRC) with pyzmq importable, or skip
    saying what is missing."""
    if source() is None:
        pytest.skip(NEEDS)
    pytest.importorskip("zmq", reason="FastDeploy's FMQ (control responses) needs pyzmq")
    tree = exported().get(commit)
    if tree is None:
        pytest.skip(f"FASTDEPLOY_SRC does not hold {commit}: {NEEDS}")
    return tree


def patched(root: Path, into: Path) -> Path:
    """The files the patch touches, patched, under ``into`` (found before the checkout's)."""
    patched_tree(root, into)
    return into


class EngineProcess:
    """``tests/helpers/fd_engine.py``: the engine code of FastDeploy line ``commit`` in a process of its own, one
    command at a time; the drop-ins it launches get ``dropin_package``'s FastDeploy."""

    def __init__(
        self, tmp: Path, instance: str, env: dict[str, str], commit: str = "e53f5184", **geometry: Any
    ) -> None:
        root = fastdeploy_line(commit)
        self.config = {**GEOMETRY, **geometry, "queue_port": free_port(), "storage": geometry.get("storage", "file")}
        self.config["suffix"] = 20000 + free_port() % 40000
        self.config["model_dir"] = str(tmp)
        self.config["engine_socket"], self.config["commit"] = ENGINE_SOCKET[commit], commit
        self.log_dir = tmp / "fdlog"
        self.log_dir.mkdir(exist_ok=True)
        patched_tree(root, tmp / "patched", PATCHES[commit])
        package = dropin_package(root, tmp / "dropin", ROOT)
        env = dict(
            env,
            FASTDEPLOY_SRC=str(root),
            KVCACHED_TEST_FD_PATCHED=str(tmp / "patched"),
            FD_LOG_DIR=str(self.log_dir),
            KVCACHED_INSTANCE=instance,
            PYTHONPATH=f"{package}{os.pathsep}{ROOT}",
        )
        self.err = tmp / "engine.err"
        with open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "helpers" / "fd_engine.py"), json.dumps(self.config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                cwd=tmp,
                start_new_session=True,  # its queue server is a child: stopped with it, as a group
            )
        self.replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        assert self._reply(60).get("ready"), self.diagnostics()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.replies.put(line)
        self.replies.put(None)

    def _reply(self, timeout: float) -> dict[str, Any]:
        """The next reply; ``EngineEnded`` once the engine has exited (its queue server, a child, may still
        hold its stdout open)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.replies.get(timeout=0.2)
                break
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise EngineEnded(self.proc.returncode, self.diagnostics()) from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"the engine gave no reply within {timeout}s\n{self.diagnostics()}") from None
        if line is None:
            raise EngineEnded(self.proc.wait(10), self.diagnostics())
        reply: dict[str, Any] = json.loads(line)
        return reply

    def call(self, op: str, timeout: float = 120, **args: Any) -> dict[str, Any]:
        """Run one command in the engine; FastDeploy's exceptions fail the test with their traceback."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply(timeout)
        assert "exception" not in reply, f"{reply['exception']}\n{reply['traceback']}\n{self.diagnostics()}"
        return reply

    def dropin_log(self, since: dict[Path, int] | None = None) -> str:
        """The drop-ins' logs; ``since``: only what was written after that ``log_mark``."""
        return "".join(
            p.read_text(errors="replace")[(since or {}).get(p, 0) :] for p in sorted(self.log_dir.glob(DROPIN_LOGS))
        )

    def log_mark(self) -> dict[Path, int]:
        """Where each drop-in's log ends now (for ``dropin_log``)."""
        return {p: len(p.read_text(errors="replace")) for p in self.log_dir.glob(DROPIN_LOGS)}

    def diagnostics(self) -> str:
        return f"engine stderr:\n{self.err.read_text(errors='replace')[-4000:]}\ndrop-ins:\n{self.dropin_log()[-6000:]}"

    def dropins(self) -> list[int]:
        """Pids of the drop-ins this engine launched (found by the engine's cache queue port)."""
        found = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            with contextlib.suppress(OSError):
                words = cmdline.read_bytes().split(b"\0")
                if (
                    b"kvcached.fastdeploy.transfer_manager" in words
                    and str(self.config["queue_port"]).encode() in words
                ):
                    found.append(int(cmdline.parent.name))
        return found

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(20)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        for pid in self.dropins():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for path in Path("/dev/shm").glob(f"fmq_ctrl_c2e_rank*_{self.config['queue_port']}.ipc"):
            path.unlink(missing_ok=True)
        Path(f"/dev/shm/fd_task_queue_{self.config['queue_port']}.sock").unlink(missing_ok=True)
        for name in (
            "cache_ready_signal",
            "swap_space_ready_signal",
            "cache_transfer_inited_signal",
            "prefix_tree_status",
            "kv_cache_status",
            "cache_task_broadcast_signal",
            "cache_task_is_paused",
            "cache_task_inflight",
        ):
            Path(f"/dev/shm/{name}.{self.config['suffix']}").unlink(missing_ok=True)


class EngineEnded(AssertionError):
    """The engine process exited (``status``: its exit status, -15 for SIGTERM)."""

    def __init__(self, status: int, diagnostics: str) -> None:
        super().__init__(f"the engine exited with {status}\n{diagnostics}")
        self.status = status


def configured(**changes: int) -> list[str]:
    """``kvcached start``'s geometry options for ``GEOMETRY`` with ``changes``."""
    g = {**GEOMETRY, **changes}
    flags = {
        "num-layers": "layers",
        "kv-heads": "kv_heads",
        "head-dim": "head_dim",
        "block-size": "block_size",
        "num-blocks": "blocks",
        "num-cpu-blocks": "cpu_blocks",
    }
    return [part for flag, key in flags.items() for part in (f"--{flag}", str(g[key]))]


def spec_of(**geometry: Any) -> rc.CacheSpec:
    g = {**GEOMETRY, **geometry}
    return rc.CacheSpec(
        num_layers=g["layers"],
        kv_heads=g["kv_heads"],
        head_dim=g["head_dim"],
        block_size=g["block_size"],
        num_blocks=g["blocks"],
        num_cpu_blocks=g["cpu_blocks"],
        storage_backend=g.get("storage", "file"),
    )


@contextlib.contextmanager
def engine_and_daemon(
    daemons: DaemonFactory,
    tmp: Path,
    *,
    daemon_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    daemon_env: dict[str, str] | None = None,
    commit: str = "e53f5184",
    **geometry: Any,
) -> Iterator[tuple[EngineProcess, Any]]:
    """A 2-rank daemon (by default ``--geometry engine`` with a file store; its environment with
    ``daemon_env`` added) and the engine code of FastDeploy line ``commit`` (its environment, and so the
    drop-ins', with ``env`` added)."""
    fastdeploy_line(commit)
    args = daemon_args if daemon_args is not None else ["--geometry", "engine"]
    args = [*args, "--storage-backend", "file", "--storage-path", str(tmp / "store")]
    daemon = daemons.start(ranks=2, small=False, args=args, env=daemons.env(**(daemon_env or {})))
    engine = EngineProcess(tmp, daemon.instance, daemons.env(**(env or {})), commit, **geometry)
    try:
        yield engine, daemon
    finally:
        engine.close()


@dataclasses.dataclass
class Shared:
    """A launched engine and its daemon, shared by tests that neither stop, kill nor reconfigure either
    (``shared_engine``); ``launched``: the engine's reply to ``launch``."""

    engine: EngineProcess
    daemon: Any
    launched: dict[str, Any]


@pytest.fixture(scope="class", params=COMMITS)
def shared_engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    """``engine_and_daemon`` with its defaults on each line, launched, for the tests of a class: its own run
    directory, its daemon stopped and its objects in /dev/shm checked (a leak fails) after the class's last
    test (its idle drop-ins poll the queue: they live no longer than that)."""
    tmp = tmp_path_factory.mktemp(f"shared-engine-{request.param}")
    with shared_daemons(tmp) as factory, engine_and_daemon(factory, tmp, commit=request.param) as (engine, daemon):
        yield Shared(engine, daemon, engine.call("launch"))


@pytest.fixture
def shared(shared_engine: Shared, monkeypatch: pytest.MonkeyPatch) -> Shared:
    """``shared_engine``, checked alive before each test (a test before may have failed with it)."""
    monkeypatch.setenv("KVCACHED_RUN_DIR", str(Path(shared_engine.engine.config["model_dir"]) / "run"))
    assert shared_engine.engine.proc.poll() is None, f"the shared engine ended\n{shared_engine.engine.diagnostics()}"
    assert shared_engine.daemon.proc.poll() is None, f"the shared daemon ended\n{shared_engine.daemon.log()}"
    return shared_engine


def views(instance: str, **geometry: Any) -> list[rc.KVCache]:
    """Each rank's cache as its runner sees it (zero-copy views of kvcached's memory)."""
    return [rc.initialize_kv_cache(spec_of(**geometry), rank, instance=instance, timeout=30) for rank in range(2)]


def fill(caches: list[rc.KVCache], ids: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    for cache in caches:
        for tensor in cache.key_caches + cache.value_caches:
            for i in ids:
                tensor[i].view(np.uint8)[...] = rng.integers(0, 256, tensor[i].view(np.uint8).shape, dtype=np.uint8)


def blocks(caches: list[rc.KVCache], ids: list[int]) -> list[bytes]:
    """Per rank, the bytes of blocks ``ids`` in every layer, key and value."""
    return [b"".join(t[i].tobytes() for t in c.key_caches + c.value_caches for i in ids) for c in caches]
