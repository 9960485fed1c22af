"""The error tree and the runner's public names: one tree under KVCacheError, drawn once, pinned here."""

from __future__ import annotations

import inspect
import re

import runner_client
from kvcached.protocol import errors

#: runner_client's public names. Adding one is fine (add it here); removing or renaming one breaks runners.
PUBLIC = [
    "CONDITION",
    "AccessDenied",
    "CacheLayoutMismatch",
    "CacheNotReady",
    "CacheSpec",
    "CacheTasks",
    "DaemonGone",
    "InvalidArgument",
    "InvalidSpec",
    "InvalidTask",
    "KVCache",
    "KVCacheError",
    "NotTrusted",
    "Owner",
    "OwnershipConflict",
    "ProtocolError",
    "RankFailed",
    "StoreUnavailable",
    "TaskFailed",
    "TaskHandle",
    "TaskLost",
    "TaskResult",
    "TaskTimeout",
    "block_keys",
    "cache_owner",
    "initialize_kv_cache",
    "should_create_cache",
    "wait_until_ready",
]


def test_runner_client_public_names_are_pinned() -> None:
    assert sorted(runner_client.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(runner_client, name) is not None


def _drawn_tree() -> dict[str, str]:
    """class -> parent, read from the tree in errors.py's docstring (indentation gives the parent)."""
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in (errors.__doc__ or "").splitlines():
        match = re.match(r"^(\s*)(?:[│ ]*)(?:[├└]── )?([A-Z][A-Za-z]+)\b", line)
        if not match or ("── " not in line and match.group(2) != "KVCacheError"):
            continue
        depth = line.index(match.group(2))
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            parents[match.group(2)] = stack[-1][1]
        stack.append((depth, match.group(2)))
    return parents


def test_every_error_is_in_the_one_tree_as_drawn() -> None:
    """Every exception class of kvcached.protocol.errors is drawn in its docstring under its real parent,
    and every class drawn exists: the picture is the code."""
    classes = {
        name: cls
        for name, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, Exception) and cls.__module__ == errors.__name__
    }
    drawn = _drawn_tree()
    assert set(drawn) | {"KVCacheError"} == set(classes)
    for name, parent in drawn.items():
        assert classes[name].__bases__[0] is classes[parent], (name, parent, classes[name].__bases__)
        assert issubclass(classes[name], errors.KVCacheError)


def test_runner_facing_errors_are_exported() -> None:
    for name in ("AccessDenied", "NotTrusted", "TaskLost", "StoreUnavailable", "TaskTimeout", "DaemonGone"):
        assert getattr(runner_client, name) is getattr(errors, name)
