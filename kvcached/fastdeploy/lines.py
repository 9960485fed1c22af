"""Which FastDeploy a host runs, and what that line does where kvcached meets it, for ``kvcached doctor``: read, never
imported; the drop-in reads none of it (each line's patch tells it what it needs).

FastDeploy changed at kvcached's seam within weeks, differently per line (``KNOWN_LINES``; how each differs:
docs/fastdeploy.md, the version matrix). ``read_tree`` reads a FastDeploy tree (a checkout, or the installed package's
directory) into a ``Tree``: the line it is (the one whose kvcached patch fits it, hunk for hunk), whether that patch is
applied, how its transfer manager reaches the cache queue and reports storage writes, and its XPU runner's condition.
Every fact is read from the tree's own files, so a tree of no known line is still described truly; only the line's name
needs kvcached's patches (``patch_dir``)."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib.util
import re
import subprocess
import sysconfig
from collections.abc import Mapping
from pathlib import Path

from kvcached.fastdeploy import patchfile
from kvcached.fastdeploy.condition import RUNNER, RunnerCondition, read_condition

MANAGER = "fastdeploy/cache_manager/cache_transfer_manager.py"
LAUNCHER = "fastdeploy/cache_manager/prefix_cache_manager.py"
#: The splitwise cache messager: it allocates the whole cache unless kvcached's hunk is in it.
MESSAGER = "fastdeploy/cache_manager/cache_messager.py"
ENVS = "fastdeploy/envs.py"
SHM_VARIABLE = "FD_ENGINE_TASK_QUEUE_WITH_SHM"
V1_VARIABLE = "ENABLE_V1_KVCACHE_MANAGER"
SHM_VALUES = "must be an integer, as FastDeploy reads it with int(): 1 (the Unix socket) or 0 (TCP)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Line:
    """A FastDeploy line kvcached has a patch for."""

    name: str
    commit: str

    @property
    def patch(self) -> str:
        """The patch's file name: named after the commit it is made against."""
        return f"fastdeploy-{self.commit}-kvcached.patch"


KNOWN_LINES = (
    Line(name="develop 2026-04-15", commit="e53f5184"),
    Line(name="2.6", commit="41677b9a6"),
    Line(name="develop 2026-05-20", commit="564c78d78"),
)


def patch_dir() -> Path | None:
    """Where kvcached's FastDeploy patches are: ``patches/`` of the source tree kvcached runs from, else
    ``<prefix>/share/kvcached/patches`` where ``pip install`` puts them. None if neither exists."""
    here = Path(__file__).resolve().parents[2] / "patches"
    installed = Path(sysconfig.get_path("data")) / "share" / "kvcached" / "patches"
    return next((d for d in (here, installed) if d.is_dir()), None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class QueueRule:
    """How a line's transfer manager forms the cache queue's address (``cache_transfer_manager.py``)."""

    #: The Unix socket path with ``{port}``, when the manager takes it under ``FD_ENGINE_TASK_QUEUE_WITH_SHM``.
    socket: str | None
    #: The variable's default as the line's ``envs.py`` has it (None when it has no such variable).
    default: int | None

    def uses_socket(self, environ: Mapping[str, str]) -> bool:
        """Whether the manager connects to the socket: ``int(os.getenv(VARIABLE, default))`` is true, as FastDeploy's
        ``envs`` reads it. Raises ``ValueError`` naming the variable for a non-integer."""
        if self.socket is None:
            return False
        raw = environ.get(SHM_VARIABLE, str(self.default if self.default is not None else 0))
        try:
            return bool(int(raw))
        except ValueError:
            raise ValueError(f"{SHM_VARIABLE}={raw!r}: {SHM_VALUES}") from None

    def describe(self, environ: Mapping[str, str]) -> str:
        if self.socket is None:
            return "TCP (pod_ip, cache_queue_port): this line's transfer manager has no other transport"
        raw = environ.get(SHM_VARIABLE)
        setting = f"{SHM_VARIABLE}={raw}" if raw is not None else f"{SHM_VARIABLE} unset, default {self.default}"
        where = self.socket.format(port="<cache_queue_port>")
        return f"Unix socket {where} ({setting})" if self.uses_socket(environ) else f"TCP ({setting})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tree:
    """What a FastDeploy tree says about itself where kvcached meets it."""

    root: Path
    line: Line | None
    #: The state of ``line``'s patch in this tree (None when no line was told or no patch was found).
    patch: patchfile.PatchState | None
    queue: QueueRule
    runner: RunnerCondition
    #: The XPU runner decides through ``runner_client`` (kvcached's patch) when KVCACHED_INSTANCE is set.
    runner_patched: bool
    #: The launcher starts kvcached's drop-in when KVCACHED_INSTANCE is set.
    launcher_patched: bool
    #: Every rank reports a storage write, listing the blocks stored (2.6); else rank 0 lists those it wrote.
    writes_reported_by_every_rank: bool
    #: Its ``envs.py`` knows ``ENABLE_V1_KVCACHE_MANAGER`` (the in-worker cache manager, #7097).
    has_v1_cache_manager: bool
    version: str | None = None
    commit: str | None = None
    #: The splitwise cache messager attaches kvcached's cache when KVCACHED_INSTANCE is set (else it allocates).
    messager_patched: bool = False
    #: How ``line`` was told: "commit" (the checkout's git commit) or "files" (its patch fits them best).
    told_by: str = "files"
    #: Another line's kvcached patch, applied to this tree (a patch of the wrong line).
    foreign: Line | None = None
    #: ``arguments.LineFacts.write_wait_s``, as the launcher's ``wait_write_storage_task`` has it (2.6: 60).
    write_wait_s: float | None = None

    @property
    def line_name(self) -> str:
        return f"{self.line.name} ({self.line.commit})" if self.line else "of a line kvcached has no patch for"


def _read(root: Path, relative: str) -> str:
    try:
        return (root / relative).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""


def read_queue_rule(root: Path) -> QueueRule:
    """The transfer manager's socket path (if it takes one under the variable) and the variable's default."""
    manager = _read(root, MANAGER)
    found = re.search(r'f"(/dev/shm/fd_task_queue_)\{args\.cache_queue_port\}(\.sock)"', manager)
    socket = f"{found.group(1)}{{port}}{found.group(2)}" if found and SHM_VARIABLE in manager else None
    return QueueRule(socket=socket, default=_env_default(_read(root, ENVS), SHM_VARIABLE))


def _env_default(envs: str, name: str) -> int | None:
    """The default of ``name`` in ``envs.py``'s table: ``"NAME": lambda: int(os.getenv("NAME", "1"))``."""
    with contextlib.suppress(SyntaxError):
        for node in ast.walk(ast.parse(envs)):
            if not isinstance(node, ast.Dict):
                continue
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == name:
                    for call in ast.walk(value):
                        if isinstance(call, ast.Call) and ast.unparse(call.func) == "os.getenv" and len(call.args) == 2:
                            default = call.args[1]
                            if isinstance(default, ast.Constant) and isinstance(default.value, str | int):
                                with contextlib.suppress(ValueError):
                                    return int(default.value)
    return None


def _every_rank_reports_writes(root: Path) -> bool:
    """Whether ``write_back_storage_task`` puts its done signal outside any ``if self.rank == 0``."""
    with contextlib.suppress(SyntaxError):
        module = ast.parse(_read(root, MANAGER))
        for function in ast.walk(module):
            if isinstance(function, ast.FunctionDef) and function.name == "write_back_storage_task":
                return not _guarded_by_rank0(function)
    return False


def _write_wait(root: Path) -> float | None:
    """The default ``timeout`` of the launcher's ``wait_write_storage_task`` (None: it has none)."""
    with contextlib.suppress(SyntaxError):
        for function in ast.walk(ast.parse(_read(root, LAUNCHER))):
            if isinstance(function, ast.FunctionDef) and function.name == "wait_write_storage_task":
                named = function.args.args[len(function.args.args) - len(function.args.defaults) :]
                for arg, default in zip(named, function.args.defaults, strict=True):
                    if arg.arg == "timeout" and isinstance(default, ast.Constant):
                        return float(default.value) if isinstance(default.value, (int, float)) else None
    return None


def _guarded_by_rank0(function: ast.FunctionDef) -> bool:
    """Whether the first ``put_transfer_done_signal`` call in ``function`` sits under ``if self.rank == 0``."""

    def visit(node: ast.AST, guarded: bool) -> bool | None:
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("put_transfer_done_signal"):
            return guarded
        branches: list[tuple[list[ast.AST], bool]]
        if isinstance(node, ast.If):
            rank0 = guarded or "self.rank == 0" in ast.unparse(node.test)
            branches = [(list(node.body), rank0), (list(node.orelse), guarded)]
        else:
            branches = [(list(ast.iter_child_nodes(node)), guarded)]
        for nodes, flag in branches:
            for child in nodes:
                if (found := visit(child, flag)) is not None:
                    return found
        return None

    return bool(visit(function, False))


def _states(root: Path) -> dict[Line, patchfile.PatchState]:
    """Each known line's patch read against the tree (lines whose patch file is not found are left out)."""
    directory = patch_dir()
    if directory is None:
        return {}
    paths = {line: directory / line.patch for line in KNOWN_LINES}
    return {line: patchfile.state(root, path) for line, path in paths.items() if path.is_file()}


def _by_files(states: dict[Line, patchfile.PatchState]) -> Line | None:
    """The line whose patch sits nearest where it was made to sit (two lines share hunks; only at its own commit are a
    patch's offsets all 0), among those whose hunks are mostly found, applied or applicable (a tree carrying another
    line's patch still has its own line's context around it)."""
    candidates = []
    for line, found in states.items():
        hunks = [state for states in found.files.values() for state in states]
        placed = sum(state in (patchfile.APPLIED, patchfile.APPLICABLE) for state in hunks)
        if hunks and 2 * placed >= len(hunks):
            candidates.append((found.distance, -placed, line.commit, line))
    return min(candidates)[-1] if candidates else None


def _identify(states: dict[Line, patchfile.PatchState], commit: str | None) -> tuple[Line | None, str, Line | None]:
    """The tree's line (by its git commit when it is one of the known lines', else by its files), how it was told, and
    another line whose patch is applied to it."""
    by_commit = next((line for line in KNOWN_LINES if commit and commit.startswith(line.commit)), None)
    line = by_commit or _by_files(states)
    foreign = next((other for other, found in states.items() if other != line and found.verdict == "applied"), None)
    return line, "commit" if by_commit else "files", foreign


def _git_commit(root: Path) -> str | None:
    if not (root / ".git").exists():
        return None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )
        if done.returncode == 0:
            return done.stdout.strip() or None
    return None


def find_root(path: Path) -> Path:
    """The directory holding ``fastdeploy/``: ``path`` itself, or its parent when ``path`` is the package. Raises
    ``FileNotFoundError`` naming what is missing."""
    for candidate in (path, path.parent):
        if (candidate / MANAGER).is_file():
            return candidate
    raise FileNotFoundError(f"{path}: no {MANAGER} (give a FastDeploy checkout or its installed package)")


def installed_root() -> Path | None:
    """The directory holding the installed ``fastdeploy`` package (found, not imported), or None."""
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("fastdeploy")
        if spec is not None and spec.submodule_search_locations:
            return Path(next(iter(spec.submodule_search_locations))).parent
    return None


def _patched(root: Path, states: list[patchfile.PatchState], relative: str, markers: tuple[str, ...]) -> bool:
    """Whether kvcached's calls are in ``relative``: a known patch's hunks of it are all applied there, or, with no
    known patch to read it by, kvcached's markers are in it."""
    if states:
        return any(found.file_applied(relative) for found in states)
    text = _read(root, relative)
    return "KVCACHED_INSTANCE" in text and any(marker in text for marker in markers)


def read_tree(path: Path) -> Tree:
    """Describe the FastDeploy tree at ``path`` (see ``find_root``)."""
    root = find_root(path)
    commit = _git_commit(root)
    states = _states(root)
    line, told_by, foreign = _identify(states, commit)
    patch = states.get(line) if line is not None else None
    known = [states[found] for found in (line, foreign) if found is not None and found in states]
    version = _read(root, "fastdeploy/version.txt").strip().splitlines()
    return Tree(
        root=root,
        line=line,
        patch=patch,
        queue=read_queue_rule(root),
        runner=read_condition(root),
        runner_patched=_patched(root, known, RUNNER, ("runner_client", "kvcached.")),
        launcher_patched=_patched(root, known, LAUNCHER, ("kvcached.fastdeploy.transfer_manager",)),
        messager_patched=_patched(root, known, MESSAGER, ("kvcached.fastdeploy.runner",)),
        writes_reported_by_every_rank=_every_rank_reports_writes(root),
        write_wait_s=_write_wait(root),
        has_v1_cache_manager=f'"{V1_VARIABLE}"' in _read(root, ENVS),
        version=version[0] if version else None,
        commit=commit,
        told_by=told_by,
        foreign=foreign,
    )
