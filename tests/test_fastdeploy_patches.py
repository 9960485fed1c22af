"""One patch per FastDeploy line, against that line's own tree (``FASTDEPLOY_SRC``: see
``tests/helpers/fastdeploy_lines.py``): each is named after its commit, applies cleanly to it and to no other line,
and the files it patches pass that tree's own pre-commit hooks (``tests/helpers/fd_hooks.py``). Skipped, saying
what they need, without FASTDEPLOY_SRC, except the naming."""

from __future__ import annotations

import py_compile
import subprocess
from pathlib import Path

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
