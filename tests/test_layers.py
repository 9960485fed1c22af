"""The house reads top-down: no module imports from a part above its own (checked on the source, imports
inside functions included)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Parts from the floor up. A module may import its own part and the parts below it, never one above.
LAYERS: list[tuple[str, ...]] = [
    ("kvcached.protocol",),
    ("kvcached.plugins", "kvcached.knobs", "kvcached.health", "kvcached.access", "kvcached.logs", "kvcached.native"),
    ("kvcached.memory", "kvcached.store"),
    ("kvcached.transfer",),
    ("kvcached.config",),
    ("kvcached.daemon",),
    ("kvcached.status", "kvcached.doctor", "kvcached.running"),
    ("kvcached.cli", "kvcached.fastdeploy"),
]
#: Parts on one floor that must not lean on each other.
SEPARATE = {("kvcached.memory", "kvcached.store"), ("kvcached.store", "kvcached.memory")}
#: What the runner's package may import of kvcached: what a runner needs to attach, nothing of the daemon.
RUNNER_MAY_IMPORT = ("kvcached.protocol", "kvcached.memory", "kvcached.plugins")
THIRD_PARTY_ON_THE_FLOOR = {"numpy", "posix_ipc"}


def part_of(module: str) -> tuple[int, str] | None:
    for level, parts in enumerate(LAYERS):
        for part in parts:
            if module == part or module.startswith(part + "."):
                return level, part
    return None


def imports_of(path: Path, package: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else f"{package.rsplit('.', node.level - 1)[0]}.{node.module}"
            found += [f"{base}.{alias.name}" for alias in node.names] if base == "kvcached" else [base]
    return [name for name in found if name != "kvcached"]


def modules(top: str) -> list[tuple[str, Path]]:
    return [
        (".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"), path)
        for path in sorted((ROOT / top).rglob("*.py"))
    ]


def test_no_import_runs_up_a_floor() -> None:
    wrong = []
    for module, path in modules("kvcached"):
        if module == "kvcached":
            continue  # the package's own __init__ imports nothing
        mine = part_of(module)
        assert mine is not None, f"{module} is on no floor: add it to LAYERS"
        for target in imports_of(path, module):
            theirs = part_of(target)
            if theirs is None:
                continue
            if theirs[0] > mine[0] or (mine[1], theirs[1]) in SEPARATE:
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_the_floor_imports_only_the_standard_library_numpy_and_posix_ipc() -> None:
    for module, path in modules("kvcached/protocol"):
        for target in imports_of(path, module):
            top = target.split(".")[0]
            assert (
                top in sys.stdlib_module_names
                or top in THIRD_PARTY_ON_THE_FLOOR
                or target.startswith("kvcached.protocol")
            ), f"{module} imports {target}"


def test_runner_client_imports_nothing_of_the_daemon() -> None:
    for module, path in modules("runner_client"):
        for target in imports_of(path, module):
            if target.startswith("kvcached"):
                assert target.startswith(RUNNER_MAY_IMPORT), f"{module} imports {target}"
