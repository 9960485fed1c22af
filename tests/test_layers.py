"""The house reads top-down: no module imports from a part above its own, and no modules import each other in
a loop (checked on the source, imports inside functions and under ``TYPE_CHECKING`` included); each check is
shown to catch one planted in a copy of the tree."""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Parts from the floor up. A module belongs to the longest part its name starts with; it may import its
#: own part and the parts below it, never one above. FastDeploy is a guest on the top floor, whole: the drop-in
#: for its cache transfer manager, the runner hooks, the adapter, its names and the doctor of a FastDeploy tree
#: are clients of the daemon, as the CLI is, that reach it through ``runner_client`` and the protocol only.
#: Below, FastDeploy is known only as data given through extension points (the names the xpu backend exports
#: under: ``kvcached.memory.xpu.name_tensors``, which ``kvcached start`` calls).
LAYERS: list[tuple[str, ...]] = [
    ("kvcached.protocol",),
    (
        "kvcached.plugins",
        "kvcached.knobs",
        "kvcached.checks",
        "kvcached.access",
        "kvcached.logs",
        "kvcached.native",
        "kvcached.variables",
    ),
    ("kvcached.memory", "kvcached.store"),
    ("runner_client",),
    ("kvcached.copy_engine",),
    ("kvcached.config", "kvcached.config_file"),
    ("kvcached.daemon",),
    ("kvcached.status", "kvcached.doctor", "kvcached.running"),
    ("kvcached.cli", "kvcached.options", "kvcached.fastdeploy"),
]
#: The floor: shared with runner_client, so it imports the standard library, numpy and posix_ipc only.
FLOOR = [(0, part) for part in LAYERS[0]]
#: Parts that must not lean on each other, whatever their floors.
SEPARATE = {
    ("kvcached.memory", "kvcached.store"),
    ("kvcached.store", "kvcached.memory"),
    ("runner_client", "kvcached.store"),
    # The drop-in is a client: what it needs of the daemon goes through runner_client and the protocol.
    ("kvcached.fastdeploy", "kvcached.daemon"),
}
#: What the runner's package may import of kvcached: what a runner needs to attach, nothing of the daemon.
RUNNER_MAY_IMPORT = ("kvcached.protocol", "kvcached.memory", "kvcached.plugins")
THIRD_PARTY_ON_THE_FLOOR = {"numpy", "posix_ipc"}


def part_of(module: str) -> tuple[int, str] | None:
    """(floor, part) of the longest part ``module`` belongs to, or None (not ours)."""
    found = [
        (level, part)
        for level, parts in enumerate(LAYERS)
        for part in parts
        if module == part or module.startswith(part + ".")
    ]
    return max(found, key=lambda hit: len(hit[1])) if found else None


def imports_of(path: Path, package: str) -> list[str]:
    """What ``path`` (module ``package``) imports; of our own packages, each name imported from them (it
    may be a module: ``from kvcached import memory``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else f"{package.rsplit('.', node.level - 1)[0]}.{node.module}"
            ours = base.split(".")[0] in ("kvcached", "runner_client")
            found += [f"{base}.{alias.name}" for alias in node.names] if ours else [base]
    return found


def modules(root: Path, top: str) -> list[tuple[str, Path]]:
    return [
        (".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"), path)
        for path in sorted((root / top).rglob("*.py"))
    ]


def upward_imports(root: Path) -> list[str]:
    """Every import under ``root``'s kvcached/ and runner_client/ that runs up a floor or across a
    separation, as "<module> imports <target>"; a module on no floor fails the check."""
    wrong = []
    for module, path in [*modules(root, "kvcached"), *modules(root, "runner_client")]:
        if module == "kvcached":
            continue  # the package's own __init__ imports nothing
        mine = part_of(module)
        assert mine is not None, f"{module} is on no floor: add it to LAYERS"
        for target in imports_of(path, module):
            theirs = part_of(target)
            if theirs is None:
                continue
            separate = any(mine[1].startswith(a) and theirs[1].startswith(b) for a, b in SEPARATE)
            if theirs[0] > mine[0] or separate:
                wrong.append(f"{module} imports {target}")
    return wrong


def module_graph(root: Path) -> dict[str, set[str]]:
    """Each of our modules under ``root`` -> the modules of ours it imports (a name imported from a package
    counts as its module when it is one, else as the package)."""
    found = dict([*modules(root, "kvcached"), *modules(root, "runner_client")])
    graph: dict[str, set[str]] = {}
    for module, path in found.items():
        targets = set()
        for name in imports_of(path, module):
            target = name
            while target and target not in found:
                target = target.rpartition(".")[0]
            if target and target != module and target.split(".")[0] in ("kvcached", "runner_client"):
                targets.add(target)
        graph[module] = targets
    return graph


def import_loops(root: Path) -> list[list[str]]:
    """Every set of modules that import each other in a loop (strongly connected, more than one), sorted."""
    graph = module_graph(root)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    loops: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(loops)


def test_no_import_runs_up_a_floor() -> None:
    assert upward_imports(ROOT) == []


def test_no_modules_import_each_other_in_a_loop() -> None:
    assert import_loops(ROOT) == []


def test_a_loop_planted_in_a_copy_is_caught(tmp_path: Path) -> None:
    """A copy of the tree where the drop-in's handlers import the manager back (under ``TYPE_CHECKING`` too)
    fails the check, naming exactly those two modules."""
    for top in ("kvcached", "runner_client"):
        shutil.copytree(ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    target = tmp_path / "kvcached/fastdeploy/handlers.py"
    planted = "if TYPE_CHECKING:\n    from kvcached.fastdeploy import transfer_manager\n"
    target.write_text("from typing import TYPE_CHECKING\n" + target.read_text() + "\n" + planted)
    assert import_loops(tmp_path) == [["kvcached.fastdeploy.handlers", "kvcached.fastdeploy.transfer_manager"]]


@pytest.mark.parametrize(
    ("path", "planted", "found"),
    [
        ("kvcached/protocol/spec.py", "import runner_client\n", "kvcached.protocol.spec imports runner_client"),
        (
            "runner_client/cache.py",
            "def later() -> None:\n    from kvcached.fastdeploy import transfer_manager\n",
            "runner_client.cache imports kvcached.fastdeploy.transfer_manager",
        ),
        (
            "kvcached/memory/xpu.py",
            "from kvcached.fastdeploy.names import TENSOR_NAMES\n",
            "kvcached.memory.xpu imports kvcached.fastdeploy.names.TENSOR_NAMES",
        ),
        (
            "kvcached/daemon/supervisor.py",
            "from kvcached.fastdeploy import guard\n",
            "kvcached.daemon.supervisor imports kvcached.fastdeploy.guard",
        ),
        (
            "kvcached/fastdeploy/mover.py",
            "from kvcached.daemon import supervisor\n",
            "kvcached.fastdeploy.mover imports kvcached.daemon.supervisor",
        ),
    ],
)
def test_an_import_planted_up_a_floor_is_caught(tmp_path: Path, path: str, planted: str, found: str) -> None:
    """A copy of the tree with one import planted up a floor (or from the drop-in into the daemon) fails
    the check, naming that import and nothing else."""
    for top in ("kvcached", "runner_client"):
        shutil.copytree(ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    target = tmp_path / path
    target.write_text(target.read_text() + "\n" + planted)
    assert upward_imports(tmp_path) == [found]


def test_the_floor_imports_only_the_standard_library_numpy_and_posix_ipc() -> None:
    for module, path in [*modules(ROOT, "kvcached"), *modules(ROOT, "runner_client")]:
        if part_of(module) not in FLOOR:
            continue
        for target in imports_of(path, module):
            top = target.split(".")[0]
            assert top in sys.stdlib_module_names or top in THIRD_PARTY_ON_THE_FLOOR or part_of(target) in FLOOR, (
                f"{module} imports {target}"
            )


def test_runner_client_imports_nothing_of_the_daemon() -> None:
    for module, path in modules(ROOT, "runner_client"):
        for target in imports_of(path, module):
            if target.startswith("kvcached"):
                assert target.startswith(RUNNER_MAY_IMPORT), f"{module} imports {target}"
