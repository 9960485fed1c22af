"""A FastDeploy runner's own cache condition, read from its source and compared with kvcached's fixed one.

Each FastDeploy line decides in ``initialize_kv_cache`` (``worker/xpu_model_runner.py``) whether the runner creates its
KV cache or attaches the one a cache manager made, with one assignment::

    create_cache_tensor = profile or self.scheduler_config.splitwise_role == "mixed"          # e53f5184, 2.6
    create_cache_tensor = profile or not (                                                    # 2026-05-20
        self.fd_config.cache_config.kvcache_storage_backend
        or self.fd_config.scheduler_config.splitwise_role != "mixed"
    )

``read_condition`` finds that assignment with ``ast`` (nothing of FastDeploy is imported or run) and
``RunnerCondition.creates`` evaluates it for a configuration of the ``INPUTS`` (whatever object holds them); anything
else makes the condition unknown rather than guessed. ``differences`` lists where it and kvcached's fixed condition
(``kvcached.protocol.ownership``) disagree, and what each costs."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcached.protocol.ownership import should_create_cache

RUNNER = "fastdeploy/worker/xpu_model_runner.py"
#: The inputs a runner condition may read, by the attribute (or name) FastDeploy gives them.
INPUTS = ("profile", "num_cpu_blocks", "kvcache_storage_backend", "splitwise_role")
TWO_COPIES = "two copies"
NO_COPY = "no copy"

_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
}


class Unknown(Exception):
    """The condition reads something other than the four inputs, or uses syntax not evaluated here."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """One configuration of the four inputs."""

    profile: bool
    num_cpu_blocks: int
    kvcache_storage_backend: str | None
    splitwise_role: str

    def describe(self) -> str:
        parts = ["profile" if self.profile else "no profile"]
        parts.append(f"CPU swap ({self.num_cpu_blocks} blocks)" if self.num_cpu_blocks > 0 else "no CPU swap")
        store = self.kvcache_storage_backend
        parts.append(f"storage {store}" if store else "no storage")
        parts.append(f"role {self.splitwise_role}")
        return ", ".join(parts)

    def fixed(self) -> bool:
        """kvcached's fixed condition: True iff the runner creates the cache."""
        return should_create_cache(self.profile, self.num_cpu_blocks, self.kvcache_storage_backend, self.splitwise_role)


#: Every combination that tells the conditions apart: CPU swap on/off, a store or none, each role.
CONFIGS = tuple(
    Config(profile=p, num_cpu_blocks=c, kvcache_storage_backend=s, splitwise_role=r)
    for p, c, s, r in itertools.product((False, True), (0, 64), (None, "file"), ("mixed", "prefill", "decode"))
)


def _evaluate(node: ast.expr, config: Config) -> Any:
    if isinstance(node, ast.BoolOp):
        values = (_evaluate(v, config) for v in node.values)
        result: Any = None
        for result in values:
            if isinstance(node.op, ast.Or) == bool(result):
                return result
        return result
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return not _evaluate(node.operand, config)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE:
        left, right = _evaluate(node.left, config), _evaluate(node.comparators[0], config)
        return _COMPARE[type(node.ops[0])](left, right)
    if isinstance(node, ast.Constant):
        return node.value
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    if name in INPUTS:
        return getattr(config, name)
    raise Unknown(ast.unparse(node))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunnerCondition:
    """The runner's ``create_cache_tensor = ...`` as its file has it."""

    path: str
    line: int = 0
    source: str = ""
    expression: ast.expr | None = dataclasses.field(default=None, compare=False, repr=False)
    #: Why it cannot be evaluated (None when it can).
    unknown: str | None = None

    def creates(self, config: Config) -> bool:
        """Whether this runner creates its own cache under ``config``. Raises ``Unknown``."""
        if self.expression is None:
            raise Unknown(self.unknown or "no condition found")
        return bool(_evaluate(self.expression, config))

    def differences(self) -> list[tuple[Config, str]]:
        """Each configuration where this condition and the fixed one disagree, with its cost: ``two copies`` (the runner
        creates while kvcached owns) or ``no copy`` (the runner waits while nobody creates)."""
        return [(c, TWO_COPIES if self.creates(c) else NO_COPY) for c in CONFIGS if self.creates(c) != c.fixed()]


def read_condition(root: Path, path: str = RUNNER) -> RunnerCondition:
    """The ``create_cache_tensor`` assignment of ``initialize_kv_cache`` in ``root/path``; ``unknown`` says why when
    there is none or it cannot be evaluated."""
    try:
        tree = ast.parse((root / path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError) as exc:
        return RunnerCondition(path=path, unknown=f"{path}: {exc}")
    for function in ast.walk(tree):
        if not (isinstance(function, ast.FunctionDef) and function.name == "initialize_kv_cache"):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["create_cache_tensor"]:
                found = RunnerCondition(
                    path=path, line=node.lineno, source=ast.unparse(node.value), expression=node.value
                )
                try:
                    found.differences()
                except Unknown as exc:
                    return dataclasses.replace(found, expression=None, unknown=f"it reads {exc}")
                return found
    return RunnerCondition(path=path, unknown="no create_cache_tensor in initialize_kv_cache")
