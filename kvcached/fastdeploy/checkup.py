"""``kvcached doctor``'s FastDeploy checks: which FastDeploy this host runs and whether it and kvcached agree.

Given a FastDeploy tree (``--fastdeploy PATH``, or the installed ``fastdeploy`` package by default), in this order:
``fastdeploy_line``, ``fastdeploy_patch``, ``fastdeploy_queue``, ``fastdeploy_runner``, then where they apply
``fastdeploy_messager`` (a patched launcher, an unpatched messager), ``fastdeploy_platform`` (an installed paddle or
FastDeploy distribution names it) and ``fastdeploy_v1_cache_manager`` (with ``ENABLE_V1_KVCACHE_MANAGER`` set);
docs/fastdeploy.md (*Which FastDeploy is this?*) says what each finds. FastDeploy's files are read
(``kvcached.fastdeploy.lines``), never imported; only here: the drop-in, which decides, reads none of them."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvcached.checks import FAIL, OK, WARN, Check
from kvcached.fastdeploy import guard
from kvcached.fastdeploy.condition import Config, Unknown
from kvcached.fastdeploy.lines import (
    KNOWN_LINES,
    MESSAGER,
    V1_VARIABLE,
    Line,
    Tree,
    installed_root,
    patch_dir,
    read_tree,
)
from kvcached.protocol.spec import CacheSpec

#: ``--fastdeploy`` values that are not paths.
AUTO, NONE = "auto", "none"


def engine_config(spec: CacheSpec) -> Config:
    """The configuration a runner decides on after its profile run, for a daemon of ``spec``."""
    return Config(
        profile=False,
        num_cpu_blocks=spec.num_cpu_blocks,
        kvcache_storage_backend=spec.storage_backend or None,
        splitwise_role=spec.splitwise_role,
    )


def double_allocation(tree: Tree, config: Config) -> str | None:
    """Why ``tree``'s XPU runner would allocate a second copy of a cache kvcached owns under ``config``, or None when it
    would not (or kvcached does not own it, or it cannot be told: see ``tree.runner.unknown``)."""
    if config.fixed() or tree.runner_patched:
        return None
    try:
        creates = tree.runner.creates(config)
    except Unknown:
        return None
    if not creates:
        return None
    runner = tree.runner
    where = f"{runner.path}:{runner.line}" if runner.line else runner.path
    fix = (
        f"apply kvcached's patch {tree.line.patch} (its runner part)"
        if tree.line
        else "make the runner decide through runner_client.cache_owner"
    )
    return (
        f"double allocation: FastDeploy's XPU runner ({where}: create_cache_tensor = {runner.source}) creates "
        f"its own KV cache with {config.describe()}, while kvcached owns this cache by the fixed condition: "
        f"two copies of the whole cache. {fix}, or run this engine without kvcached"
    )


def messager_double(tree: Tree, splitwise_role: str) -> str | None:
    """Why ``tree``'s cache messager would allocate a second copy in ``splitwise_role``, or None."""
    if splitwise_role == "mixed" or tree.messager_patched:
        return None
    path = tree.root / MESSAGER
    text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    found = re.search(r"^\s*for i in range\(args\.num_layers", text, re.MULTILINE)
    where = f"{MESSAGER}:{text.count(chr(10), 0, found.start()) + 1}" if found else MESSAGER
    fix = f"apply kvcached's patch {tree.line.patch} whole (its cache_messager.py part)" if tree.line else "patch it"
    return (
        f"double allocation: FastDeploy's cache messager ({where}: its loop over the layers), which the launcher "
        f"starts in the {splitwise_role} role, creates its own KV cache and exports it under the names kvcached's "
        f"tensors have (set_data_ipc), while kvcached owns this cache: two copies of the whole cache. {fix}, "
        "or run this engine without kvcached"
    )


def checks(spec: CacheSpec, where: str | None = AUTO, environ: Mapping[str, str] = os.environ) -> list[Check]:
    """The FastDeploy checks for a daemon of ``spec``. ``where``: a path, ``auto`` (the installed package; no checks
    when there is none) or ``none``."""
    if where is None or where == NONE:
        return []
    root = installed_root() if where == AUTO else Path(where)
    if root is None:
        return []
    try:
        tree = read_tree(root)
    except FileNotFoundError as exc:
        advice = "give --fastdeploy a FastDeploy checkout (the directory holding fastdeploy/) or its installed package"
        return [Check("fastdeploy_line", FAIL, str(exc), {"path": str(root)}, advice)]
    found = [check_line(tree), check_patch(tree), check_queue(tree, environ), check_runner(tree, spec)]
    more = (check_messager(tree, spec), check_platform(installed_platform()), check_v1(tree, environ))
    return found + [check for check in more if check is not None]


def check_line(tree: Tree) -> Check:
    measured: dict[str, Any] = {
        "root": str(tree.root),
        "line": tree.line.name if tree.line else None,
        "line_commit": tree.line.commit if tree.line else None,
        "version": tree.version,
        "commit": tree.commit,
        "told_by": tree.told_by,
    }
    told = "told by its git commit" if tree.told_by == "commit" else "told by its files"
    at = f"at commit {tree.commit[:9]}" if tree.commit else None
    extra = ", ".join(x for x in (tree.version, at, told if tree.line else None) if x)
    figure = f"FastDeploy {tree.line_name} at {tree.root}" + (f" ({extra})" if extra else "")
    if tree.line is not None:
        return Check("fastdeploy_line", OK, figure, measured)
    known = "; ".join(f"{line.name} ({line.commit})" for line in KNOWN_LINES)
    where = patch_dir()
    advice = (
        f"kvcached has patches for: {known}; none fits this tree, hunk for hunk (the checks below read its "
        "files as they are)"
        if where is not None
        else "kvcached's patches were not found (a source checkout's patches/, or <prefix>/share/kvcached/patches)"
    )
    return Check("fastdeploy_line", WARN, figure, measured, advice)


def check_patch(tree: Tree) -> Check:
    if tree.foreign is not None:
        return _foreign_patch(tree, tree.foreign)
    if tree.line is None or tree.patch is None:
        measured: dict[str, Any] = {"patch": None}
        measured.update(launcher_patched=tree.launcher_patched, runner_patched=tree.runner_patched)
        marks = [name for name, on in (("launcher", tree.launcher_patched), ("runner", tree.runner_patched)) if on]
        found = f"; kvcached calls found in its {' and '.join(marks)}" if marks else ""
        figure = f"no kvcached patch for this line{found}"
        verdict = WARN if marks else FAIL
        advice = (
            "without the patch the engine starts its own cache_transfer_manager.py, which allocates the whole cache "
            "beside kvcached's: use a FastDeploy line kvcached supports (docs/fastdeploy.md, the version matrix)"
        )
        return Check("fastdeploy_patch", verdict, figure, measured, advice)
    where = patch_dir()
    path = where / tree.line.patch if where is not None else Path(tree.line.patch)
    measured = {
        "patch": str(path),
        "state": tree.patch.verdict,
        "files": {name: list(states) for name, states in tree.patch.files.items()},
    }
    figure = f"{tree.line.patch}: {tree.patch.verdict}"
    if tree.patch.verdict == "applied":
        return Check("fastdeploy_patch", OK, figure, measured)
    clean = "" if tree.patch.verdict == "not applied" else "git checkout -- fastdeploy (a clean tree first), then "
    advice = (
        f"cd {tree.root} && {clean}git apply {path} (then reinstall FastDeploy if it runs from an installed "
        "package): without it the engine starts its own cache_transfer_manager.py, which allocates the whole "
        "cache beside kvcached's"
    )
    return Check("fastdeploy_patch", FAIL, figure, measured, advice)


def _foreign_patch(tree: Tree, foreign: Line) -> Check:
    """Another line's patch applied to this tree: a failure, whatever it changes (each line's patch is made, and its
    hooks run, against that line's files)."""
    own = tree.line.patch if tree.line is not None else "the patch of its line"
    figure = f"{foreign.patch} (for FastDeploy {foreign.name}) is applied to this {tree.line_name} tree"
    measured = {"patch": foreign.patch, "state": "another line's patch", "line": foreign.name}
    advice = f"apply {own} to a clean checkout of this tree (git checkout -- fastdeploy, then git apply)"
    return Check("fastdeploy_patch", FAIL, figure, measured, advice)


def check_queue(tree: Tree, environ: Mapping[str, str]) -> Check:
    measured: dict[str, Any] = {
        "socket": tree.queue.socket,
        "default": tree.queue.default,
        "variable": environ.get("FD_ENGINE_TASK_QUEUE_WITH_SHM"),
    }
    try:
        measured["transport"] = "unix" if tree.queue.uses_socket(environ) else "tcp"
        figure = tree.queue.describe(environ)
    except ValueError as exc:
        measured["transport"] = None
        return Check("fastdeploy_queue", FAIL, str(exc), measured, "set it to 1 or 0, or unset it")
    return Check("fastdeploy_queue", OK, f"the cache queue over {figure}", measured)


def check_runner(tree: Tree, spec: CacheSpec) -> Check:
    runner = tree.runner
    measured: dict[str, Any] = {
        "path": runner.path,
        "line": runner.line,
        "condition": runner.source,
        "patched": tree.runner_patched,
        "equals_fixed": None,
        "differences": [],
    }
    where = f"{runner.path}:{runner.line}"
    if runner.unknown is not None:
        measured["unknown"] = runner.unknown
        advice = "read the runner's initialize_kv_cache: kvcached cannot tell whether it allocates a second copy"
        figure = f"{runner.path}: condition not understood ({runner.unknown})"
        return Check("fastdeploy_runner", WARN, figure, measured, advice)
    try:
        differences = runner.differences()
    except Unknown as exc:  # pragma: no cover - read_condition has evaluated it once already
        return Check("fastdeploy_runner", WARN, f"{where}: {exc}", measured)
    measured["equals_fixed"] = not differences
    measured["differences"] = [{"config": c.describe(), "cost": cost} for c, cost in differences]
    own = f"{where}: create_cache_tensor = {runner.source}"
    if tree.runner_patched:
        figure = f"with KVCACHED_INSTANCE set kvcached decides, by the fixed condition; without it, {own}"
        return Check("fastdeploy_runner", OK, figure, measured)
    double = double_allocation(tree, engine_config(spec))
    if double is not None:
        return Check("fastdeploy_runner", FAIL, double, measured, "apply the patch (fastdeploy_patch above)")
    if differences:
        listed = "; ".join(f"{c.describe()}: {cost}" for c, cost in differences)
        figure = f"{own}: differs from the fixed condition where {listed}"
        advice = "not for this daemon's configuration; apply the patch before changing it"
        return Check("fastdeploy_runner", WARN, figure, measured, advice)
    return Check("fastdeploy_runner", OK, f"{own}: equals the fixed condition", measured)


def check_messager(tree: Tree, spec: CacheSpec) -> Check | None:
    """The splitwise cache messager, when the launcher starts the drop-in but the messager is not patched."""
    if tree.messager_patched or not tree.launcher_patched:
        return None
    measured = {"path": MESSAGER, "patched": False, "role": spec.splitwise_role}
    double = messager_double(tree, spec.splitwise_role)
    if double is not None:
        return Check("fastdeploy_messager", FAIL, double, measured, "apply the patch whole (fastdeploy_patch above)")
    figure = f"{MESSAGER} is not patched: in a prefill or decode role it allocates the whole cache beside kvcached's"
    return Check("fastdeploy_messager", WARN, figure, measured, "apply the patch whole before using a splitwise role")


#: The distributions that tell FastDeploy's platform without importing paddle (first found wins).
PLATFORM_DISTRIBUTIONS = (
    ("paddlepaddle-xpu", "xpu"),
    ("fastdeploy-xpu", "xpu"),
    ("paddlepaddle-gpu", "gpu"),
    ("fastdeploy-gpu", "gpu"),
)


def installed_platform() -> tuple[str, str] | None:
    """(platform, the distribution that says so), from the installed paddle or FastDeploy build; None."""
    for distribution, platform in PLATFORM_DISTRIBUTIONS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version(distribution)
            return platform, distribution
    return None


def check_platform(found: tuple[str, str] | None) -> Check | None:
    """FastDeploy's platform here (``found``): kvcached serves it on XPU only."""
    if found is None:
        return None
    platform, distribution = found
    measured = {"platform": platform, "distribution": distribution}
    refusal = guard.platform_refusal(platform)
    if refusal is None:
        return Check("fastdeploy_platform", OK, f"FastDeploy runs on {platform} ({distribution} installed)", measured)
    advice = "run FastDeploy on a Kunlun XPU host to use kvcached; the drop-in refuses to serve on this one"
    return Check("fastdeploy_platform", FAIL, f"{refusal} ({distribution} installed)", measured, advice)


def check_v1(tree: Tree, environ: Mapping[str, str]) -> Check | None:
    raw = environ.get(V1_VARIABLE)
    if not tree.has_v1_cache_manager or raw in (None, "", "0"):
        return None
    figure = (
        f"{V1_VARIABLE}={raw}: FastDeploy's in-worker cache manager starts no cache transfer manager, so the "
        "kvcached drop-in never runs: its CPU pool and store serve nothing (the patched runner still attaches "
        "kvcached's device cache: one copy)"
    )
    return Check("fastdeploy_v1_cache_manager", WARN, figure, {"variable": raw}, f"unset {V1_VARIABLE} to use kvcached")
