"""One patch per FastDeploy line, against that line's own tree (``FASTDEPLOY_SRC``: see
``tests/helpers/fastdeploy_lines.py``): each is named after its commit, applies cleanly to it and to no other line,
and the files it patches pass that tree's own pre-commit hooks (``tests/helpers/fd_hooks.py``). Skipped, saying
what they need, without FASTDEPLOY_SRC, except the naming and the launcher's watcher (the patch's own code,
run from the patch)."""

from __future__ import annotations

import contextlib
import os
import py_compile
import signal
import subprocess
import textwrap
import threading
import time
import types
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import pytest

from kvcached.fastdeploy import patchfile
from kvcached.fastdeploy.lines import KNOWN_LINES, read_tree
from tests.conftest import ROOT
from tests.helpers import fastdeploy_lines
from tests.helpers.fastdeploy_lines import PATCHES, tree_of
from tests.helpers.fd_hooks import run_hooks

line_trees, patched_trees = fastdeploy_lines.line_trees, fastdeploy_lines.patched_trees  # session fixtures
COMMITS = [line.commit for line in KNOWN_LINES]


def files_of(commit: str) -> list[str]:
    return sorted({hunk.path for hunk in patchfile.parse(PATCHES[commit].read_text())})


def test_one_patch_per_line_named_after_its_commit() -> None:
    """patches/ holds exactly fastdeploy-<commit>-kvcached.patch for each line kvcached supports."""
    assert sorted(p.name for p in (ROOT / "patches").glob("*.patch")) == sorted(
        f"fastdeploy-{commit}-kvcached.patch" for commit in COMMITS
    )


@pytest.mark.parametrize("commit", COMMITS)
def test_the_patch_applies_cleanly_to_its_commit(line_trees: dict[str, Path], commit: str) -> None:
    """``git apply --check`` passes on the line's own tree, with no offset or fuzz warning."""
    tree = tree_of(line_trees, commit)
    check = subprocess.run(
        ["git", "apply", "--check", "--verbose", str(PATCHES[commit])],
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stderr
    assert "with fuzz" not in check.stderr and "offset" not in check.stderr, check.stderr


@pytest.mark.parametrize("commit", COMMITS)
def test_each_tree_is_told_its_own_line(line_trees: dict[str, Path], commit: str) -> None:
    """Each tree is identified as its own line, unpatched and patched: its patch fits at offset 0, and another
    line's patch either does not fit or fits only farther away (2.6 and develop 2026-05-20 share hunks)."""
    tree = tree_of(line_trees, commit)
    own = patchfile.state(tree, PATCHES[commit])
    assert own.fits and own.distance == 0
    for other in COMMITS:
        if other != commit:
            theirs = patchfile.state(tree, PATCHES[other])
            assert not theirs.fits or theirs.distance > 0, f"{PATCHES[other].name} fits {commit} as well as its own"
    found = read_tree(tree).line
    assert found is not None and found.commit == commit


@pytest.mark.parametrize("commit", COMMITS)
def test_the_patched_files_pass_the_lines_own_pre_commit_hooks(patched_trees: dict[str, Path], commit: str) -> None:
    """black, isort, flake8 and ruff at the versions the line pins, with its configuration, and its whitespace
    hooks: no complaint about any file the patch touches; each compiles."""
    tree = tree_of(patched_trees, commit)
    files = files_of(commit)
    for relative in files:
        py_compile.compile(str(tree / relative), doraise=True)
    failed = run_hooks(tree, files)
    assert not failed, "\n".join(f"== {hook}\n{said}" for hook, said in failed.items())


@pytest.mark.parametrize("commit", COMMITS)
def test_the_patched_tree_launches_the_drop_in_and_its_runner_asks_kvcached(
    patched_trees: dict[str, Path], commit: str
) -> None:
    """What the patch is for, read from the patched files: with KVCACHED_INSTANCE set the launcher starts
    ``-m kvcached.fastdeploy.transfer_manager`` and passes no ``--create_cache_tensor``, and the XPU runner
    asks kvcached (which decides with the fixed condition) before its own condition."""
    tree = tree_of(patched_trees, commit)
    launcher = (tree / "fastdeploy/cache_manager/prefix_cache_manager.py").read_text()
    runner = (tree / "fastdeploy/worker/xpu_model_runner.py").read_text()
    assert "-m kvcached.fastdeploy.transfer_manager" in launcher and "and not kvcached" in launcher
    asks = runner.index('os.environ.get("KVCACHED_INSTANCE")')
    assert asks < runner.index("create_cache_tensor = profile"), "kvcached decides first"
    found = read_tree(tree)
    assert found.patch is not None and found.patch.verdict == "applied"
    assert found.launcher_patched and found.runner_patched


class _Recorded:
    """DOUBLES of what the patched watcher calls outside itself: FastDeploy's ``console_logger`` (records the
    lines), ``os`` (``kill`` records the signal the engine would get; everything else is ``os``'s) and
    ``time`` (``sleep`` lasts a tenth of what it is asked: the watcher looks every 0.1 s, not every second)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.kills: list[tuple[int, int]] = []

    def error(self, line: str) -> None:
        self.lines.append(line)

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    def kill(self, pid: int, signum: int) -> None:
        self.kills.append((pid, signum))

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(seconds / 10)


def patched_watcher(commit: str, recorded: _Recorded) -> object:
    """The patch's own ``_kvcached_watch``, executed from its added lines (in this repository: no FastDeploy
    needed), with ``recorded`` for FastDeploy's logger and ``os``."""
    hunk = next(h for h in patchfile.parse(PATCHES[commit].read_text()) if "def _kvcached_watch" in "".join(h.after))
    start = next(i for i, line in enumerate(hunk.after) if "def _kvcached_watch" in line)
    end = next(i for i, line in enumerate(hunk.after) if i > start and line.startswith("    def "))
    namespace: dict[str, object] = {"time": recorded, "signal": signal, "os": recorded, "console_logger": recorded}
    namespace["envs"] = types.SimpleNamespace(FD_LOG_DIR="/fdlog")
    exec(textwrap.dedent("\n".join(hunk.after[start:end])), namespace)
    return namespace["_kvcached_watch"]


@pytest.mark.parametrize("commit", COMMITS)
def test_the_watcher_stops_the_engine_at_any_drop_in_exit_naming_it_and_watches_on(commit: str) -> None:
    """The launcher's watcher (each line's patch, its own code) against real processes started as FastDeploy
    starts the drop-ins (a shell, a session of its own): the stand-by rank's killed (``kill -9``), then rank
    0 fails: each stops the engine (SIGTERM to itself), naming the rank and how it ended; once the engine
    clears its task flag (it stops the drop-ins itself), their ends are not reported."""
    recorded = _Recorded()
    watch: Any = patched_watcher(commit, recorded)
    flag = shared_memory.SharedMemory(create=True, size=4)  # cache_task_broadcast_signal, as IPCSignal holds it
    launcher = types.SimpleNamespace(shm_cache_task_flag_broadcast=types.SimpleNamespace(shm=flag))
    shell = {"shell": True, "preexec_fn": os.setsid}
    processes = [subprocess.Popen("sleep 1.5; exit 1", **shell), subprocess.Popen("sleep 60; exit $?", **shell)]
    try:
        watcher = threading.Thread(target=watch, args=(launcher, processes), daemon=True)
        watcher.start()
        time.sleep(0.5)
        sleeper = int(Path(f"/proc/{processes[1].pid}/task/{processes[1].pid}/children").read_text().split()[0])
        os.kill(sleeper, signal.SIGKILL)  # the drop-in under its shell: the shell exits 128 + 9
        watcher.join(30)
        assert not watcher.is_alive()
        assert recorded.kills == [(os.getpid(), signal.SIGTERM)] * 2
        assert "rank 1 ended (killed by signal 9)" in recorded.lines[0] and "/fdlog/" in recorded.lines[0]
        assert "rank 0 ended (exit status 1)" in recorded.lines[1]
        # the engine stopping: it clears the flag, then stops the drop-ins' process groups
        recorded.kills.clear()
        processes = [subprocess.Popen("sleep 60", **shell)]
        watcher = threading.Thread(target=watch, args=(launcher, processes), daemon=True)
        watcher.start()
        flag.close()  # IPCSignal.clear
        os.killpg(processes[0].pid, signal.SIGTERM)
        watcher.join(30)
        assert not watcher.is_alive() and recorded.kills == []
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        flag.close()
        flag.unlink()
