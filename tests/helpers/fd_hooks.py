"""FastDeploy's own pre-commit hooks, at the versions its tree pins, run on files of that tree.

``.pre-commit-config.yaml`` pins black, isort, flake8 and ruff (``rev:``); ``hooks_bin`` takes them from
``KVCACHED_TEST_FD_HOOKS`` (a directory holding their executables, each checked to be the pinned version),
else installs exactly those into a virtual environment kept under ``~/.cache/kvcached/``, built once under
a lock so that test processes side by side share it; pip fails loudly. ``run_hooks``
runs each as its hook does, from the tree's root so that its ``pyproject.toml`` and ``.flake8`` apply, in
check mode (black ``--check``, isort ``--check-only``, ruff without ``--fix``), plus the whitespace hooks of
``pre-commit-hooks`` (trailing whitespace, the final newline, merge-conflict markers). pre-commit itself is
not used: it clones the hooks' repositories, and only the package index is reachable here.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

#: The hook repositories kvcached runs, and the package each installs.
PACKAGES = {
    "psf/black": "black",
    "PyCQA/isort": "isort",
    "PyCQA/flake8": "flake8",
    "astral-sh/ruff-pre-commit": "ruff",
}
MARKERS = ("<<<<<<< ", "======= ", ">>>>>>> ")


def pins(tree: Path) -> dict[str, str]:
    """``{package: version}`` from the tree's ``.pre-commit-config.yaml`` (``repo:`` then ``rev:``)."""
    text = (tree / ".pre-commit-config.yaml").read_text()
    found: dict[str, str] = {}
    for repo, rev in re.findall(r"repo:\s*(\S+)\s*\n\s*rev:\s*(\S+)", text):
        for name, package in PACKAGES.items():
            if name in repo:
                found[package] = rev.removeprefix("v")
    missing = set(PACKAGES.values()) - set(found)
    assert not missing, f"{tree / '.pre-commit-config.yaml'} pins no {sorted(missing)}"
    return found


def hooks_bin(versions: dict[str, str]) -> Path:
    """A directory with the hooks' executables at exactly ``versions``: ``KVCACHED_TEST_FD_HOOKS``, or the
    ``bin`` of a virtual environment with them installed (and ``toml``, black's hook dependency)."""
    return _hooks_bin(tuple(sorted(versions.items())), os.environ.get("KVCACHED_TEST_FD_HOOKS"))


@functools.cache
def _hooks_bin(pinned: tuple[tuple[str, str], ...], given: str | None) -> Path:
    versions = dict(pinned)
    if given:
        asked = {
            package: subprocess.Popen([str(Path(given) / package), "--version"], stdout=subprocess.PIPE, text=True)
            for package in versions
        }
        for package, proc in asked.items():
            said, _ = proc.communicate(timeout=60)
            assert versions[package] in said, (
                f"KVCACHED_TEST_FD_HOOKS: {package} is not {versions[package]}: {said[:80]}"
            )
        return Path(given)
    key = hashlib.sha256(repr(sorted(versions.items())).encode()).hexdigest()[:12]
    venv = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvcached" / f"fd-hooks-{key}"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = venv / "installed"
        if not done.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
            wanted = [f"{package}=={version}" for package, version in sorted(versions.items())] + ["toml"]
            pip = subprocess.run(
                [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", *wanted],
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
            assert pip.returncode == 0, f"could not install FastDeploy's hooks {wanted}:\n{pip.stdout}{pip.stderr}"
            done.write_text("\n".join(wanted))
    return venv / "bin"


def _whitespace(tree: Path, relative: str) -> list[str]:
    """What ``trailing-whitespace``, ``end-of-file-fixer`` and ``check-merge-conflict`` would flag."""
    text = (tree / relative).read_text()
    lines = text.split("\n")
    problems = [f"{relative}:{n}: trailing whitespace" for n, line in enumerate(lines, 1) if line.rstrip() != line]
    problems += [
        f"{relative}:{n}: conflict marker"
        for n, line in enumerate(lines, 1)
        if line.startswith(MARKERS) or line == "======="
    ]
    if text and (not text.endswith("\n") or text.endswith("\n\n")):
        problems.append(f"{relative}: does not end with exactly one newline")
    return problems


def run_hooks(tree: Path, files: list[str]) -> dict[str, str]:
    """``{hook: what it said}`` for each hook that fails on ``files`` (paths relative to ``tree``)."""
    bin_dir = hooks_bin(pins(tree))
    commands = {
        "black": [str(bin_dir / "black"), "--check", "--diff", *files],
        "isort": [str(bin_dir / "isort"), "--check-only", "--diff", *files],
        "flake8": [str(bin_dir / "flake8"), *files],
        "ruff": [str(bin_dir / "ruff"), "check", "--line-length=120", "--config", "pyproject.toml", *files],
    }
    running = {
        hook: subprocess.Popen(command, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for hook, command in commands.items()
    }  # side by side: each reads the files only
    failed = {}
    for hook, proc in running.items():
        said, _ = proc.communicate(timeout=300)
        if proc.returncode != 0:
            failed[hook] = said
    whitespace = [problem for relative in files for problem in _whitespace(tree, relative)]
    if whitespace:
        failed["pre-commit-hooks"] = "\n".join(whitespace)
    return failed
